"""The reliability suite: fault scenarios judged by the history checker.

Quick mode runs inside the test suite; ``python -m tests.reliability.soak`` loops the same
scenarios with larger counts (see docs/reliability.md).
"""
