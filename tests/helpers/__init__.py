"""Modules the tests import (tests/ is on sys.path under pytest; the scripts
in tests/scripts/ put it there): shared inputs, references and checks, the
multi-process plumbing and the background CUDA compile check."""
