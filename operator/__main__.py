"""Reconcile ModelDeployments into per-region worker fleets (same as `meridian operator`)."""

import argparse
import sys

from meridian.operator.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="meridian operator", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
