"""python3 -m kvd.engine.worker --target unix:///run/kvd/kvd.sock [--pool default] [--prompts FILE]

Serves prompts from FILE (or stdin), one JSON object a line:
  {"id": "r1", "prompt": [1, 2, 3], "max_new": 4, "adapter": "", "salt": "", "checkpoint_every": 0,
   "resume": false}
("resume": continue request r1's checkpoint, left by a worker that died.)
and prints one JSON line per request: {"id", "cached_tokens", "tokens", "digest"} (digest: SHA-256
of every float32 logit row it sampled from). Several workers can run at once against one kvd."""
import argparse
import json
import os
import signal
import sys

from kvd.client import Client
from kvd.engine.engine import Engine
from kvd.engine.model import Config


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvd.engine.worker")
    ap.add_argument("--target", required=True)
    ap.add_argument("--pool", default="default")
    ap.add_argument("--prompts", help="JSON lines file (default: stdin)")
    ap.add_argument("--name", default="engine")
    ap.add_argument("--die-after-checkpoints", type=int, default=0,
                    help="SIGKILL this process right after its Nth checkpoint (a crash, for tests)")
    ap.add_argument("--stop-after-checkpoints", type=int, default=0,
                    help="SIGSTOP this process right after its Nth checkpoint (a hung worker, for tests)")
    ap.add_argument("--wrong-layer-stride", action="store_true",
                    help="read reused KV from the wrong layer (proves the exactness check can fail)")
    args = ap.parse_args(argv)
    src = open(args.prompts) if args.prompts else sys.stdin
    # The pool must hold KV the way this model reads it; kvd refuses the Attach otherwise.
    with Client(args.target, worker_name=args.name, expect=[Config().expectation(args.pool)]) as client:
        engine = Engine(client, args.pool, wrong_layer_stride=args.wrong_layer_stride)
        checkpoints = 0

        def on_checkpoint():
            nonlocal checkpoints
            checkpoints += 1
            if checkpoints == args.die_after_checkpoints:
                print(json.dumps({"died_after_checkpoints": checkpoints}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if checkpoints == args.stop_after_checkpoints:
                print(json.dumps({"stopped_after_checkpoints": checkpoints}), flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)

        for line in src:
            if not line.strip():
                continue
            r = json.loads(line)
            out = engine.generate(r["id"], r["prompt"], r.get("max_new", 4), r.get("adapter", ""),
                                  r.get("salt", ""), r.get("checkpoint_every", 0), r.get("resume", False),
                                  on_checkpoint)
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
