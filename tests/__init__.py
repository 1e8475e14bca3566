"""eyas's test suite. A package, so that its helpers import as ``tests.support`` (see conftest.py)."""
