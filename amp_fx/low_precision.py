"""Low-precision recipes per module (``amp_fx.compile(..., low_precision=...)``).

``low_precision=`` (``fp8=`` is its older spelling, with the same values) takes one recipe for
every matmul with a parameter operand (``"rowwise"``, an :class:`~amp_fx.Fp8Recipe`, an
:class:`~amp_fx.Fp8Config`), or a recipe per module: a :class:`LowPrecision`, or a plain dict
``{selector: recipe or None}`` (the modules it does not select stay in ``dtype``). A selector is
a module's qualified name (covering its descendants), an ``nn.Module`` subclass, or
:class:`Blocks`, the first or last N of the model's repeated blocks; ``None`` keeps the selected
modules' matmuls in ``dtype`` (high precision).

The rule: each matmul takes the recipe of the most specific selector that matches one of its
enclosing modules, the selector naming the deepest module (a name selects the module it names, a
type the innermost module of that type around the matmul, :class:`Blocks` the blocks it names);
at the same depth a name or block beats a type, and among equals the later entry wins. A matmul
no selector matches takes ``LowPrecision.recipe`` (None: ``dtype``).

    >>> lp = LowPrecision.keep_ends(recipe="mxfp8")
    >>> lp.recipe, dict(lp.modules)
    (<Fp8Recipe.MXFP8: 'mxfp8'>, {Blocks(first=1, last=1, of=None): None, 'lm_head': None})
    >>> recipe_for(lp, [("", object), ("lm_head", torch.nn.Linear)])
    (None, "'lm_head'")
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Union

import torch

from amp_fx.fp8 import Fp8Config, Fp8Recipe, Nvfp4Options

if TYPE_CHECKING:
    from amp_fx._common.report import Reporter

__all__ = [
    "Blocks",
    "LowPrecision",
    "LowPrecisionLike",
    "one_option",
    "of",
    "recipes",
    "recipe_for",
    "recipe_text",
    "label",
    "bind",
    "with_blocks",
    "code",
]


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """The first ``first`` and the last ``last`` of the model's repeated blocks (a
    ``nn.ModuleList``/``nn.ModuleDict`` of modules of one type: ``model.layers`` of a transformers
    Llama, ``layers`` of torchtitan's, ``transformer.h`` of GPT-2), as a key of
    :class:`LowPrecision`'s ``modules``.

    Args:
        first: how many blocks from the start.
        last: how many blocks from the end (the two may overlap).
        of: the block list's qualified name; None: the list of two or more modules of one type
            that holds the most parameters (found when the model is compiled; an error where
            there is none).
    """

    first: int = 0
    last: int = 0
    of: str | None = None

    def __post_init__(self) -> None:
        for name in ("first", "last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TypeError(f"amp_fx: Blocks.{name} must be an int >= 0, got {value!r}")
        if self.first == 0 and self.last == 0:
            raise ValueError("amp_fx: Blocks(first=0, last=0) selects no block; give first= or last=")
        if self.of is not None and not (isinstance(self.of, str) and self.of):
            raise TypeError(f"amp_fx: Blocks.of must be a module's qualified name or None, got {self.of!r}")

    def paths(self, root: torch.nn.Module) -> tuple[str, ...]:
        """The qualified names of the blocks selected in ``root``."""
        name = self.of if self.of is not None else _block_list(root)
        try:
            blocks = root.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"amp_fx: Blocks(of={name!r}): {type(root).__name__} has no submodule {name!r}"
                f"{_did_you_mean(name, root)}"
            ) from None
        if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
            raise ValueError(
                f"amp_fx: Blocks(of={name!r}) names a {type(blocks).__name__}, not a block list "
                "(nn.ModuleList, nn.ModuleDict or nn.Sequential)"
            )
        keys = [k for k, _ in blocks.named_children()]
        chosen = keys[: self.first] + keys[len(keys) - min(self.last, len(keys)) :]
        return tuple(f"{name}.{k}" for k in dict.fromkeys(chosen))


Selector = Union[str, type, Blocks]
RecipeLike = Union[str, Fp8Recipe, None]


def _rebuild(
    recipe: Fp8Recipe | None,
    modules: dict[Selector, Fp8Recipe | None],
    block_paths: dict[Blocks, tuple[str, ...]],
    nvfp4: Nvfp4Options | None,
) -> LowPrecision:
    """A pickled :class:`LowPrecision` (by keyword: the parent's fields come first)."""
    return LowPrecision(recipe=recipe, modules=modules, block_paths=block_paths, nvfp4=nvfp4)


@dataclass(frozen=True)
class LowPrecision(Fp8Config):
    """A low-precision recipe per module, as given to ``amp_fx.compile(..., low_precision=...)``.

    Args:
        recipe: the recipe of the matmuls no selector of ``modules`` matches (an
            :class:`~amp_fx.Fp8Recipe` or its name), or None to keep them in ``dtype``.
        modules: ``{selector: recipe or None}``: a module's qualified name (``"lm_head"``,
            ``"model.layers.0"``: it covers the module's descendants), an ``nn.Module``
            subclass, or :class:`Blocks`; a recipe, its name, or None (the matmuls stay in
            ``dtype``). Which selector decides a matmul: the module doc of
            :mod:`amp_fx.low_precision`. Names are checked against the model when it is
            compiled; one that is not the model's, or that matches no matmul, is reported
            (strict mode: an error).

    Every recipe of the map must suit ``dtype`` (``"mxfp8"`` needs bf16); ``amp_fx.explain``
    shows each matmul's recipe and the selector that chose it.

        >>> LowPrecision(recipe="rowwise", modules={"lm_head": None, Blocks(last=2): "mxfp8"}).recipes
        (<Fp8Recipe.ROWWISE: 'rowwise'>, <Fp8Recipe.MXFP8: 'mxfp8'>)
    """

    recipe: Fp8Recipe | None = None  # type: ignore[assignment]
    modules: Mapping[Selector, Fp8Recipe | None] = field(default_factory=dict)
    block_paths: Mapping[Blocks, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)
    """Each :class:`Blocks` selector's block names in the compiled model (:func:`bind` fills it)."""

    if TYPE_CHECKING:

        def __init__(
            self,
            recipe: RecipeLike = None,
            modules: Mapping[Selector, RecipeLike] = ...,
            block_paths: Mapping[Blocks, tuple[str, ...]] = ...,
            nvfp4: Nvfp4Options | None = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        if self.recipe is not None:
            super().__post_init__()
        if not isinstance(self.modules, Mapping):
            raise TypeError(
                f"amp_fx: LowPrecision.modules must be a mapping {{selector: recipe or None}}, got {self.modules!r}"
            )
        modules: dict[Selector, Fp8Recipe | None] = {}
        for sel, recipe in self.modules.items():
            _check_selector(sel)
            modules[sel] = None if recipe is None else Fp8Config(recipe).recipe
        if self.recipe is None and not any(r is not None for r in modules.values()):
            raise ValueError(
                "amp_fx: this low-precision map runs no matmul in low precision: give LowPrecision a "
                f"recipe, or map a module to one of {[r.value for r in Fp8Recipe]}"
            )
        object.__setattr__(self, "modules", MappingProxyType(modules))
        object.__setattr__(self, "block_paths", MappingProxyType(dict(self.block_paths)))

    def __hash__(self) -> int:
        return hash((self.recipe, tuple(self.modules.items())))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:  # read-only mappings do not pickle
        return (_rebuild, (self.recipe, dict(self.modules), dict(self.block_paths), self.nvfp4))

    @property
    def recipes(self) -> tuple[Fp8Recipe, ...]:
        """Every recipe this map can run a matmul in, the default first."""
        found = [self.recipe, *self.modules.values()]
        return tuple(dict.fromkeys(r for r in found if r is not None))

    @classmethod
    def keep_ends(
        cls, *, recipe: Fp8Recipe | str, blocks: int = 1, head: str | None = "lm_head", of: str | None = None
    ) -> LowPrecision:
        """The anchors' common choice: ``recipe`` everywhere but the first and last ``blocks`` of
        the repeated blocks and the output head (``head``: its qualified name, None for none),
        which stay in ``dtype`` (Megatron's ``--first-last-layers-bf16``; torchtitan's NVFP4
        converter keeps the last blocks and the head). ``of``: the block list, as in
        :class:`Blocks`."""
        modules: dict[Selector, RecipeLike] = {Blocks(first=blocks, last=blocks, of=of): None}
        if head is not None:
            modules[head] = None
        return cls(recipe=recipe, modules=modules)


LowPrecisionLike = Union[None, str, Fp8Recipe, Fp8Config, Mapping[Selector, RecipeLike]]


def of(value: object) -> Fp8Config | None:
    """The config for a ``low_precision=``/``fp8=`` argument: None (off), a recipe or its name
    (an :class:`Fp8Config`), an :class:`Fp8Config` or :class:`LowPrecision` as given, or a dict
    ``{selector: recipe or None}`` (a :class:`LowPrecision` without a default recipe)."""
    if isinstance(value, Mapping):
        return LowPrecision(modules=value)
    if value is None or isinstance(value, (str, Fp8Recipe, Fp8Config)):
        return Fp8Config.of(value)
    raise TypeError(
        f"amp_fx: low_precision must be None, a low-precision recipe {[r.value for r in Fp8Recipe]}, an "
        f"amp_fx.Fp8Recipe, an amp_fx.Fp8Config, an amp_fx.LowPrecision or a dict {{module: recipe or None}}, "
        f"got {value!r} ({type(value).__name__})"
    )


def one_option(fp8: LowPrecisionLike, low_precision: LowPrecisionLike, where: str) -> LowPrecisionLike:
    """The one of ``fp8=`` (the older spelling) and ``low_precision=`` that was given."""
    if fp8 is not None and low_precision is not None:
        raise TypeError(
            f"{where}: got both fp8={fp8!r} and low_precision={low_precision!r}; fp8= is the older "
            "spelling of low_precision=: pass one"
        )
    return low_precision if low_precision is not None else fp8


def recipes(config: Fp8Config | None) -> tuple[Fp8Recipe, ...]:
    """Every recipe ``config`` can run a matmul in."""
    if config is None:
        return ()
    if isinstance(config, LowPrecision):
        return config.recipes
    return (config.recipe,)


def recipe_text(config: Fp8Config) -> str:
    """``config`` as messages name it: ``'rowwise'``, or ``'mxfp8' per module`` for a map."""
    if isinstance(config, LowPrecision) and config.modules:
        return f"{config.recipe.value if config.recipe else None!r} with a per-module map"
    return repr(config.recipe.value)


def recipe_for(config: Fp8Config, stack: Sequence[tuple[str, type]]) -> tuple[Fp8Recipe | None, str | None]:
    """(the recipe, the selector that chose it, as text) of a matmul inside ``stack``, its
    enclosing modules outermost first as (qualified name, type); the selector is None where the
    default recipe applies. The rule is in the module doc."""
    if not isinstance(config, LowPrecision):
        return config.recipe, None
    best: tuple[int, int, int] | None = None
    chosen: tuple[Fp8Recipe | None, str | None] = (config.recipe, None)
    for order, (sel, recipe) in enumerate(config.modules.items()):
        depth = _depth(sel, stack, config.block_paths)
        if depth is None:
            continue
        rank = (depth, not isinstance(sel, type), order)
        if best is None or rank > best:
            best, chosen = rank, (recipe, label(sel))
    return chosen


def label(sel: Selector) -> str:
    """A selector as messages name it."""
    return sel.__name__ if isinstance(sel, type) else repr(sel)


def _depth(
    sel: Selector, stack: Sequence[tuple[str, type]], block_paths: Mapping[Blocks, tuple[str, ...]]
) -> int | None:
    """The depth (dots + 1; the root 0) of the module ``sel`` selects around a matmul inside
    ``stack``, or None where it selects none."""
    if isinstance(sel, type):
        found = [path for path, mtype in stack if isinstance(mtype, type) and issubclass(mtype, sel)]
        return _path_depth(found[-1]) if found else None
    names = block_paths.get(sel, ()) if isinstance(sel, Blocks) else (sel,)
    for name in names:
        if any(path == name or path.startswith(name + ".") for path, _ in stack):
            return _path_depth(name)
    return None


def _path_depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _check_selector(sel: object) -> None:
    if isinstance(sel, Blocks) or (isinstance(sel, str) and sel):
        return
    if isinstance(sel, type) and issubclass(sel, torch.nn.Module):
        return
    raise TypeError(
        f"amp_fx: a low-precision map's key must be a module's qualified name, an nn.Module subclass or "
        f"amp_fx.Blocks(...), got {sel!r}"
    )


def _block_list(root: torch.nn.Module) -> str:
    """The qualified name of ``root``'s repeated blocks: the ModuleList/ModuleDict/Sequential of
    two or more modules of one type that holds the most parameters."""
    best: tuple[int, str] | None = None
    for name, module in root.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name)
    if best is None:
        raise ValueError(
            f"amp_fx: Blocks(...) found no repeated blocks in {type(root).__name__} (a ModuleList, ModuleDict or "
            "Sequential of two or more modules of one type); name the block list with Blocks(of='...')"
        )
    return best[1]


def _did_you_mean(name: str, root: torch.nn.Module) -> str:
    known = [n for n, _ in root.named_modules() if n]
    close = sorted(k for k in known if k.split(".")[-1] == name.split(".")[-1])[:5] or difflib.get_close_matches(
        name, known, n=3
    )
    return f" (did you mean {close}?)" if close else ""


def bind(config: Fp8Config | None, root: object, reporter: Reporter) -> Fp8Config | None:
    """``config`` with its :class:`Blocks` selectors resolved to ``root``'s block names, each name
    selector checked against ``root``: one that is not ``root``'s is reported through
    ``reporter`` with the names it may mean (strict mode: an error). Compiling a function
    (``root`` not a module), the names cannot be checked and the blocks not found: reported."""
    if not isinstance(config, LowPrecision) or not config.modules:
        return config
    names = [s for s in config.modules if isinstance(s, (str, Blocks))]
    if not isinstance(root, torch.nn.Module):
        if names:
            reporter.did_less(
                ("low_precision", "no module"),
                (
                    f"amp_fx: low_precision's map names modules {[label(s) for s in names]}, but a function "
                    f"was compiled, not an nn.Module: they select nothing. Compile the module (or pass it as "
                    f"compile_step's model) to apply them."
                ),
            )
        return config
    known = {n for n, _ in root.named_modules()}
    for sel in names:
        if isinstance(sel, str) and sel not in known:
            reporter.did_less(
                ("low_precision", sel),
                (
                    f"amp_fx: low_precision's map names module {sel!r}, which {type(root).__name__} does not have"
                    f"{_did_you_mean(sel, root)}: it selects nothing. Names are as in the model's "
                    f"named_modules()."
                ),
            )
    return with_blocks(config, root)


def with_blocks(config: Fp8Config | None, root: object) -> Fp8Config | None:
    """``config`` with its :class:`Blocks` selectors resolved to ``root``'s block names (as it is,
    where there are none or ``root`` is not a module)."""
    if not isinstance(config, LowPrecision) or not isinstance(root, torch.nn.Module):
        return config
    paths = {sel: sel.paths(root) for sel in config.modules if isinstance(sel, Blocks)}
    if not paths:
        return config
    return LowPrecision(recipe=config.recipe, modules=config.modules, block_paths=paths, nvfp4=config.nvfp4)


def code(config: LowPrecision) -> str:
    """``config`` as the code that builds it, with the names ``amp_fx`` exports
    (``LowPrecision(recipe="rowwise", modules={"lm_head": None})``): what ``advise`` prints for
    the user to paste into ``amp_fx.compile(..., low_precision=...)``.

        >>> code(LowPrecision(recipe="mxfp8", modules={"lm_head": None, Blocks(last=2): "rowwise"}))
        'LowPrecision(recipe="mxfp8", modules={"lm_head": None, Blocks(first=0, last=2, of=None): "rowwise"})'
    """

    def text(value: object) -> str:
        if value is None:
            return "None"
        if isinstance(value, Fp8Recipe):
            return f'"{value.value}"'
        if isinstance(value, str):
            return f'"{value}"'
        if isinstance(value, type):
            return ("nn." if value.__module__.startswith("torch.nn") else f"{value.__module__}.") + value.__qualname__
        return repr(value)  # Blocks, Nvfp4Options: dataclasses whose repr is their constructor call

    modules = ", ".join(f"{text(k)}: {text(v)}" for k, v in config.modules.items())
    options = "" if config.nvfp4 is None else f", nvfp4={text(config.nvfp4)}"
    return f"LowPrecision(recipe={text(config.recipe)}, modules={{{modules}}}{options})"
