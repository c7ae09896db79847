"""The reference engine as a worker process: a tiny transformer (kvd.engine.model.TinyDecoder,
random float32 weights from a fixed seed, vocabulary of 97 token ids 0..96) whose paged KV cache is
kvd's memory. It reuses every prefix kvd has cached and publishes what it computes.

Input: prompts from --prompts FILE (or stdin), one JSON object a line; only "id" and "prompt" are
required:
  {"id": "r1", "prompt": [1, 2, 3], "max_new": 4, "adapter": "", "salt": "", "checkpoint_every": 0,
   "resume": false}
  ("resume": continue request r1's checkpoint, left by a worker that died.)
Output: one JSON line per request: {"id", "cached_tokens", "tokens", "digest", ...} (digest:
SHA-256 of every float32 logit row it sampled from; a second run of the same prompt reports
cached_tokens > 0 and the same tokens and digest).

The pool (--pool, default "tiny-engine", which a kvd without a config serves) must be declared for
this model: float32, 2 kv heads x 8 dims, token_kv_head_dim, 2 layers x 128 bytes per token; kvd
refuses the attach otherwise. Several workers can run at once against one kvd.

  echo '{"id": "r1", "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}' \
      | python3 -m kvd.engine.worker
"""
import argparse
import json
import os
import signal
import sys

from kvd.client import Client
from kvd.engine.engine import Engine
from kvd.engine.model import Config


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m kvd.engine.worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None,
                    help="kvd address (default: $KVD_TARGET, else kvd's default socket for this user)")
    ap.add_argument("--pool", default="tiny-engine", help="a pool declared for this model (see above)")
    ap.add_argument("--prompts", help="JSON lines file (default: stdin)")
    ap.add_argument("--name", default="engine")
    ap.add_argument("--die-after-checkpoints", type=int, default=0,
                    help="SIGKILL this process right after its Nth checkpoint (a crash, for tests)")
    ap.add_argument("--stop-after-checkpoints", type=int, default=0,
                    help="SIGSTOP this process right after its Nth checkpoint (a hung worker, for tests)")
    ap.add_argument("--peer", default="",
                    help="a peer kvd (a name in kvd's transfer.peers) to pull cached prefixes from")
    ap.add_argument("--wrong-layer-stride", action="store_true",
                    help="read reused KV from the wrong layer (proves the exactness check can fail)")
    args = ap.parse_args(argv)
    src = open(args.prompts) if args.prompts else sys.stdin
    # The pool must hold KV the way this model reads it; kvd refuses the Attach otherwise.
    with Client(args.target, worker_name=args.name, expect=[Config().expectation(args.pool)]) as client:
        engine = Engine(client, args.pool, wrong_layer_stride=args.wrong_layer_stride, peer=args.peer)
        checkpoints = 0
        vocab = Config().vocab
        failed = False

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
            r, problem = _parse(line, vocab)
            if problem:
                print(json.dumps({"error": problem, "line": line.strip()[:200]}), flush=True)
                failed = True
                continue
            out = engine.generate(r["id"], r["prompt"], r.get("max_new", 4), r.get("adapter", ""),
                                  r.get("salt", ""), r.get("checkpoint_every", 0), r.get("resume", False),
                                  on_checkpoint)
            print(json.dumps(out), flush=True)
    return 1 if failed else 0


def _parse(line, vocab):
    """(request, None), or (None, what is wrong with the line) without touching kvd."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e}"
    if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not r["id"]:
        return None, 'expected an object with a non-empty string "id"'
    prompt = r.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None, f'request {r["id"]}: "prompt" must be a non-empty list of token ids'
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            return None, f'request {r["id"]}: token id {t!r} is outside the model\'s vocabulary 0..{vocab - 1}'
    return r, None


if __name__ == "__main__":
    sys.exit(main())
