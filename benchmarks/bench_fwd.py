"""Forward benchmark, same as `flash-gen bench` (the logic lives in flash_gen/bench.py).

    python benchmarks/bench_fwd.py --hdim 64,128,256 --causal both --json bench_fwd.json
"""

import sys

from flash_gen.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
