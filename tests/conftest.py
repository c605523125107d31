"""Shared test set-up: hypothesis profiles and the examples folder on the path."""

from __future__ import annotations

import os
import sys

from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

# `ci` is derandomised so CI is reproducible; `dev` explores new examples on every run.
# (40 examples since 2026-12-01, 60 before: the suite has to stay under 30 minutes on a
# slower 2-core machine)
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
