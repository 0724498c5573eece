"""The torch.compile backend amp_fx hands Dynamo (``compiler.AmpBackend``) and what it keeps
around the graphs it compiles: names under the root module, weights split by graph breaks,
guards, audits, and the weight cache."""

from amp_fx.backend.compiler import AmpBackend

__all__ = ["AmpBackend"]
