#!/usr/bin/env python3
"""A hostile caller of a kvd's Peer service (run inside another network namespace by
netns_pull.py): tries to take offers and read leased blocks as nobody (no client certificate),
as a CA-signed name kvd does not allow, and as the allowed peer with leases it was never given.
Prints one JSON object: for each attempt, the gRPC status code name it got ("OK" only where it
got bytes).

Usage: peer_attack.py ADDRESS SERVER_NAME CERT_DIR. Messages are encoded by hand (field
numbers from proto/kvd/peer/v1/peer.proto), so nothing but grpcio is needed."""
import json
import sys

import grpc


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number, value):  # a varint field
    return varint(number << 3) + varint(value)


def read_request(lease, first=0, count=1024):
    return field(1, lease) + field(2, first) + field(3, count)


def offer_request(tokens):
    pool = b"\x0a\x07default"  # Namespace {pool: "default"}
    ns = b"\x0a" + varint(len(pool)) + pool
    packed = b"".join(varint(t) for t in tokens)
    return ns + b"\x12" + varint(len(packed)) + packed + field(5, 1000)


def channel(address, server_name, cert_dir, who):
    ca = open(f"{cert_dir}/ca.pem", "rb").read()
    key = open(f"{cert_dir}/{who}.key", "rb").read() if who else None
    cert = open(f"{cert_dir}/{who}.pem", "rb").read() if who else None
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", server_name)])


def call(ch, method, payload):
    try:
        resp = ch.unary_unary(f"/kvd.peer.v1.Peer/{method}")(payload, timeout=5)
        return "OK" if resp else "OK_EMPTY"
    except grpc.RpcError as e:
        return e.code().name


def main():
    address, server_name, cert_dir = sys.argv[1:4]
    results = {}
    for who in ("", "stranger"):
        ch = channel(address, server_name, cert_dir, who)
        label = who or "nobody"
        results[f"{label}:offer"] = call(ch, "Offer", offer_request(list(range(1, 200))))
        results[f"{label}:read"] = sorted({call(ch, "Read", read_request(lease)) for lease in range(1, 33)})
    # The allowed peer, with leases it does not hold (released, expired or never its own).
    ch = channel(address, server_name, cert_dir, "node-b")
    results["node-b:read"] = sorted({call(ch, "Read", read_request(lease)) for lease in range(1, 65)})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
