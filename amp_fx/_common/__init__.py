"""What every floor of amp_fx shares: torch-version differences, autocast devices, dtype names,
code objects of its own per compiled model, the downstream backend resolver, the shortfall reporter.

Nothing here imports from the rest of amp_fx except ``amp_fx.errors`` (and ``devices`` from the
op tables of ``amp_fx.policy``, lazily); ``tests/project/test_layering.py`` checks it.
"""
