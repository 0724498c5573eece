"""Adapters to other frameworks: Hugging Face (``amp_fx.hf``), Lightning (``amp_fx.lightning``) and
the torch.compile backend by name (``torch.compile(model, backend="amp_fx")``).

Each is a thin layer over the public API (``amp_fx.compile``, ``amp_fx.options_of``,
``amp_fx.GradScaler``); none is imported by ``import amp_fx``, so their libraries stay optional.
"""
