"""Fault schedules, fault-injecting runners and invariant checkers."""
