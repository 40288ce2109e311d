"""Helpers the tests share (cases, derived bounds, reference implementations, server helpers), and
the test tree's paths."""

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent
ROOT = TESTS_DIR.parent
DATA_DIR = TESTS_DIR / "data"
GOLDEN_PATH = DATA_DIR / "smollm2_135m.json"  # the default model's facts and golden greedy outputs
