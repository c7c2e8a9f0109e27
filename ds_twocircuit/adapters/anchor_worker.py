"""Entry point of the anchor worker process (started by the anchor rank's supervisor)."""
import sys

from ds_twocircuit.train import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
