"""The long chaos run (issue 16): ``tests.chaos`` for ``--minutes`` of faults.

    flock /tmp/wb-tests.lock .venv/bin/python bench/chaos.py --minutes 20 [--seed N] [--rate 50]

Every fault kind of :data:`tests.chaos.FAULTS` is injected the same number of
times, spread over ``--minutes`` (gaps drawn from the seed); the broker stays
frozen for ``message.timeout.ms`` (``--message-timeout``) + 2 s. Prints the
seed first and the table at the end (fault → times injected → recovery p50/max
→ lost rows → duplicate rows); exits 1 if anything was lost, duplicated, not
converged or exited by itself. Servers run under a fresh temp dir, removed
afterwards. Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.chaos import FAULTS, Chaos  # noqa: E402

# Seconds one round of every fault takes beyond its gaps and the freeze
# (restarts, waiting for a Spark worker to kill): measured in the CI run.
ROUND_COST_S = 10.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--rate", type=int, default=50, help="pgbench -R (transactions per second)")
    ap.add_argument("--message-timeout", type=float, default=10.0, help="producer message.timeout.ms, in seconds")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"chaos seed {seed} (replay: bench/chaos.py --seed {seed} --minutes {args.minutes:g})", flush=True)
    budget = args.minutes * 60
    # A round of every kind costs its gaps (mean 2 * gap each), the freeze and ROUND_COST_S.
    gap = 5.0
    rounds = max(1, int(budget // (len(FAULTS) * 2 * gap + ROUND_COST_S + args.message_timeout + 2)))
    print(f"{rounds} of each fault kind", flush=True)
    base = Path(tempfile.mkdtemp(prefix="walbridge-chaos-"))
    try:
        result = Chaos(base, seed, rounds=rounds, gap=(gap, 3 * gap), rate=args.rate,
                       message_timeout_s=args.message_timeout, settle_timeout=600,
                       say=lambda s: print(s, flush=True)).run()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(result.table())
    for problem in result.problems:
        print("PROBLEM:", problem)
    return 1 if result.problems or result.lost_rows or result.duplicate_rows else 0


if __name__ == "__main__":
    sys.exit(main())
