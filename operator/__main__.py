"""Reconcile ModelDeployments into per-region worker fleets (same as `meridian operator`)."""

import argparse
import logging
import sys

from meridian.operator.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="meridian operator", description=__doc__)
add_arguments(parser)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(run(parser.parse_args()))
