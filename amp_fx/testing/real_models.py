"""Real third-party models, random init and small configs, for the real-model test tier.

The zoo (:mod:`amp_fx.testing.zoo`) holds models written for the tests; this module builds the
models people train, from their own libraries: Hugging Face ``transformers`` (GPT-2, BERT, Llama,
Qwen2, Mixtral, T5, ViT, ConvNeXt, and the state-space models Mamba, FalconMamba and Jamba),
``torchvision``, ``timm`` and ``diffusers`` UNets. Nothing is downloaded: every model is built
from a config with random weights, under a fixed seed.

Each entry's :meth:`RealModel.build` returns ``(model, inputs, loss_fn)``:

* ``model``: fp32, on the CPU, in training mode, with every dropout probability set to 0 (eager
  and compiled runs then draw no random numbers, so they can be compared bit for bit);
* ``inputs``: a dict of keyword inputs, called as ``model(**inputs)`` (how users call Hugging Face
  and diffusers models; torchvision and timm models take ``x=``);
* ``loss_fn``: maps the output to a scalar fp32 loss with ops outside eager autocast's CPU table
  (``.float()``, ``pow``, ``mean``), or reads the loss the model computed in its forward
  (Hugging Face models given ``labels``): the same value inside and outside an autocast region.

Sizes: Hugging Face transformers 2 layers x hidden 64, vocabulary 128, batch 2 x 16 tokens (the
state-space models: hidden 32, one Mamba layer; Jamba adds an attention layer with 2 experts);
images 32x32 (Hugging Face, torchvision ViT) or 64x64 (torchvision and timm CNNs, timm ViT),
``num_classes=10``; UNets ``block_out_channels=(32, 64)``, ``norm_num_groups=8``, 16x16.

:data:`REAL_MODELS` maps each name to its entry; :meth:`RealModel.missing` names the library an
entry needs that does not import here (torchvision does not load with torch's CPU-only wheel,
and timm imports torchvision), so that tests skip with the reason.

    >>> model, inputs, loss_fn = REAL_MODELS["hf_gpt2"].build()  # needs transformers
    >>> loss_fn(model(**inputs)).shape
    torch.Size([])
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from amp_fx.policy import Policy

__all__ = [
    "LLAMA_4_LAYERS",
    "LLAMA_GQA",
    "GEMMA3_SLIDING",
    "GEMMA3_FULL_LAYER",
    "REAL_MODELS",
    "RealModel",
    "RealStep",
    "eager_autocast_real_step",
    "library_missing",
    "output_tensors",
    "real_step",
]

SEED = 0
LossFn = Callable[[Any], Tensor]
Built = tuple[nn.Module, dict[str, Tensor], LossFn]

_VOCAB, _SEQ, _BATCH = 128, 16, 2


# --- losses -------------------------------------------------------------------------------------


def _sq_mean(out: Any) -> Tensor:
    """Mean of squares in fp32 of the model's (first) output tensor: autocast-neutral ops."""
    t = out if isinstance(out, Tensor) else (out.sample if hasattr(out, "sample") else out[0])
    return t.float().pow(2).mean()


def _hf_loss(out: Any) -> Tensor:
    """The loss a Hugging Face model computed in its forward from ``labels`` (cross_entropy there:
    an autocast op, inside the compiled graph and inside eager's autocast region alike)."""
    return out.loss.float()


# --- library checks -----------------------------------------------------------------------------


@functools.cache
def library_missing(name: str) -> str | None:
    """None if ``name`` imports here, else why not (the exception, in a line)."""
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 (torchvision raises RuntimeError with torch's CPU wheel)
        return f"{name} does not import with torch {torch.__version__}: {type(e).__name__}: {str(e)[:160]}"
    return None


def _no_dropout(model: nn.Module) -> nn.Module:
    """Every dropout, stochastic-depth and drop-path probability to 0: no random numbers drawn."""
    for m in model.modules():
        for attr in ("p", "drop_prob"):
            value = getattr(m, attr, None)
            if isinstance(value, float) and not isinstance(m, nn.Parameter):
                setattr(m, attr, 0.0)
    return model.train()


def _ids(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randint(0, _VOCAB, shape, generator=gen)


def _images(gen: torch.Generator, size: int, channels: int = 3) -> Tensor:
    return torch.randn(_BATCH, channels, size, size, generator=gen)


# --- Hugging Face transformers ------------------------------------------------------------------

_HF_DIMS: dict[str, Any] = dict(
    vocab_size=_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def _hf_causal(config: Any, model_cls: Any, gen: torch.Generator) -> Built:
    model = model_cls(config)
    ids = _ids(gen, _BATCH, _SEQ)
    return _no_dropout(model), {"input_ids": ids, "labels": ids}, _hf_loss


def _hf_gpt2(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.GPT2Config(
        vocab_size=_VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return _hf_causal(config, tf.GPT2LMHeadModel, gen)


def _hf_bert(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.BertConfig(**_HF_DIMS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = tf.BertForMaskedLM(config)
    ids = _ids(gen, _BATCH, _SEQ)
    return _no_dropout(model), {"input_ids": ids, "labels": ids}, _hf_loss


def _hf_llama(gen: torch.Generator, kv_heads: int = 4, layers: int | None = None) -> Built:
    import transformers as tf

    dims = _HF_DIMS if layers is None else {**_HF_DIMS, "num_hidden_layers": layers}
    config = tf.LlamaConfig(**dims, num_key_value_heads=kv_heads, use_cache=False)
    return _hf_causal(config, tf.LlamaForCausalLM, gen)


def _hf_llama_4_layers(gen: torch.Generator) -> Built:
    return _hf_llama(gen, layers=4)


def _hf_llama_gqa(gen: torch.Generator) -> Built:
    return _hf_llama(gen, kv_heads=2)


def _hf_gemma3(gen: torch.Generator, second_layer: str = "sliding_attention") -> Built:
    import transformers as tf

    config = tf.Gemma3TextConfig(
        **_HF_DIMS,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=_SEQ // 2,
        layer_types=["sliding_attention", second_layer],
        use_cache=False,
    )
    return _hf_causal(config, tf.Gemma3ForCausalLM, gen)


def _hf_gemma3_full_layer(gen: torch.Generator) -> Built:
    return _hf_gemma3(gen, second_layer="full_attention")


def _hf_qwen2(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.Qwen2Config(**_HF_DIMS, num_key_value_heads=4, use_cache=False)
    return _hf_causal(config, tf.Qwen2ForCausalLM, gen)


def _hf_mixtral(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.MixtralConfig(
        **_HF_DIMS, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, use_cache=False
    )
    return _hf_causal(config, tf.MixtralForCausalLM, gen)


def _hf_t5(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.T5Config(  # type: ignore[call-arg]  # decoder_start_token_id: a PreTrainedConfig keyword
        vocab_size=_VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = tf.T5ForConditionalGeneration(config)
    return _no_dropout(model), {"input_ids": _ids(gen, _BATCH, _SEQ), "labels": _ids(gen, _BATCH, 8)}, _hf_loss


def _hf_vit(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.ViTConfig(  # type: ignore[call-arg]  # num_labels: a PreTrainedConfig keyword
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = tf.ViTForImageClassification(config)
    labels = torch.randint(0, 10, (_BATCH,), generator=gen)
    return _no_dropout(model), {"pixel_values": _images(gen, 32), "labels": labels}, _hf_loss


def _hf_convnext(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.ConvNextConfig(  # type: ignore[call-arg]  # num_labels: a PreTrainedConfig keyword
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, image_size=32
    )
    model = tf.ConvNextForImageClassification(config)
    labels = torch.randint(0, 10, (_BATCH,), generator=gen)
    return _no_dropout(model), {"pixel_values": _images(gen, 32), "labels": labels}, _hf_loss


# State-space models: transformers' Mamba mixer scans with torch's associative_scan
# (combine_mode="generic": a torch.vmap'd combine function) only while Dynamo compiles; eagerly it
# runs a sequential loop. hidden 32 with state 8 keeps the scan's graph small (the scan over 16
# tokens unrolls into 2 * log2(16) vmap'd levels per layer).
_SSM_DIMS: dict[str, Any] = dict(vocab_size=_VOCAB, hidden_size=32, use_cache=False)
_SSM_MODULES = ("mamba", "falcon_mamba", "jamba")


def _hf_mamba(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.MambaConfig(**_SSM_DIMS, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4)
    return _hf_causal(config, tf.MambaForCausalLM, gen)


def _hf_falcon_mamba(gen: torch.Generator) -> Built:
    import transformers as tf

    config = tf.FalconMambaConfig(**_SSM_DIMS, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4)
    return _hf_causal(config, tf.FalconMambaForCausalLM, gen)


def _hf_jamba(gen: torch.Generator) -> Built:
    import transformers as tf

    # Layer 0 a Mamba mixer with a dense MLP, layer 1 attention with a mixture of 2 experts (top 1).
    config = tf.JambaConfig(
        **_SSM_DIMS,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    )
    return _hf_causal(config, tf.JambaForCausalLM, gen)


@contextlib.contextmanager
def _ssm_traced_path() -> Iterator[None]:
    """Eager runs the state-space models' compiled path: transformers' ``is_torchdynamo_compiling``
    reads True in their modeling modules, so the mixer scans with ``associative_scan`` eagerly too
    (Dynamo traces the same branch)."""
    modules = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in _SSM_MODULES]
    saved = [getattr(m, "is_torchdynamo_compiling") for m in modules]
    for m in modules:
        setattr(m, "is_torchdynamo_compiling", lambda: True)
    try:
        yield
    finally:
        for m, fn in zip(modules, saved, strict=True):
            setattr(m, "is_torchdynamo_compiling", fn)


# --- torchvision ----------------------------------------------------------------------------------


def _torchvision(name: str, size: int, **kwargs: Any) -> Callable[[torch.Generator], Built]:
    def make(gen: torch.Generator) -> Built:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs)
        return _no_dropout(model), {"x": _images(gen, size)}, _sq_mean

    make.__name__ = f"_tv_{name}"
    return make


def _tv_vit(gen: torch.Generator) -> Built:
    from torchvision.models import VisionTransformer

    model = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=10
    )
    return _no_dropout(model), {"x": _images(gen, 32)}, _sq_mean


# --- timm -----------------------------------------------------------------------------------------


def _timm(name: str, **kwargs: Any) -> Callable[[torch.Generator], Built]:
    def make(gen: torch.Generator) -> Built:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        return _no_dropout(model), {"x": _images(gen, 64)}, _sq_mean

    make.__name__ = f"_timm_{name}"
    return make


# --- diffusers ------------------------------------------------------------------------------------

_UNET_DIMS: dict[str, Any] = dict(sample_size=16, block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1)


def _unet2d(gen: torch.Generator) -> Built:
    from diffusers import UNet2DModel

    model = UNet2DModel(
        **_UNET_DIMS,
        in_channels=3,
        out_channels=3,
        attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    inputs = {"sample": _images(gen, 16), "timestep": torch.tensor([10, 500])}
    return _no_dropout(model), inputs, _sq_mean  # type: ignore[arg-type]  # mypy does not see diffusers' ModelMixin(torch.nn.Module) base


def _unet2d_condition(gen: torch.Generator) -> Built:
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        **_UNET_DIMS,
        in_channels=4,
        out_channels=4,
        cross_attention_dim=32,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    inputs = {
        "sample": _images(gen, 16, channels=4),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(_BATCH, 8, 32, generator=gen),
    }
    return _no_dropout(model), inputs, _sq_mean  # type: ignore[arg-type]  # mypy does not see diffusers' ModelMixin(torch.nn.Module) base


# --- the registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RealModel:
    """A real model from a third-party library: its name, the library it needs and its factory."""

    name: str
    library: str
    """The module that must import (``transformers``, ``torchvision``, ``timm``, ``diffusers``)."""
    factory: Callable[[torch.Generator], Built]
    policy: Policy = field(default_factory=Policy)
    """The policy the tier compiles it with (``amp_fx.compile(..., policy=entry.policy)``)."""
    traced_path: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    """For a model that runs other code eagerly than traced: a context under which eager runs the
    traced code, so that eager autocast is a reference for the same computation (tests enter it for
    the whole test; docs/parity.md, "Models that branch on being compiled")."""

    def missing(self) -> str | None:
        """Why this entry cannot be built here, or None."""
        return library_missing(self.library)

    def build(self) -> Built:
        """The model, its keyword inputs and its loss function; identical on every call (seeded)."""
        torch.manual_seed(SEED)  # nn.Module initialisers draw from the global generator
        return self.factory(torch.Generator().manual_seed(SEED + 1))


REAL_MODELS: dict[str, RealModel] = {
    e.name: e
    for e in (
        RealModel("hf_gpt2", "transformers", _hf_gpt2),
        RealModel("hf_bert", "transformers", _hf_bert),
        RealModel("hf_llama", "transformers", _hf_llama),
        RealModel("hf_qwen2", "transformers", _hf_qwen2),
        # The tier compares with eager autocast, which runs Mixtral's grouped expert GEMMs in fp32
        # (no autocast table lists them): the policy says so, instead of the warning amp_fx gives.
        RealModel("hf_mixtral", "transformers", _hf_mixtral, policy=Policy(autocast_experts=False)),
        RealModel("hf_t5", "transformers", _hf_t5),
        RealModel("hf_vit", "transformers", _hf_vit),
        RealModel("hf_convnext", "transformers", _hf_convnext),
        RealModel("hf_mamba", "transformers", _hf_mamba, traced_path=_ssm_traced_path),
        RealModel("hf_falcon_mamba", "transformers", _hf_falcon_mamba, traced_path=_ssm_traced_path),
        # Jamba's attention layer holds a mixture of experts: fp32 experts, as Mixtral's.
        RealModel(
            "hf_jamba", "transformers", _hf_jamba, traced_path=_ssm_traced_path, policy=Policy(autocast_experts=False)
        ),
        RealModel("tv_resnet18", "torchvision", _torchvision("resnet18", 64)),
        RealModel("tv_mobilenet_v3_small", "torchvision", _torchvision("mobilenet_v3_small", 64)),
        RealModel("tv_efficientnet_b0", "torchvision", _torchvision("efficientnet_b0", 64)),
        RealModel("tv_swin_t", "torchvision", _torchvision("swin_t", 64)),
        RealModel("tv_vit", "torchvision", _tv_vit),
        RealModel("timm_convnext_atto", "timm", _timm("convnext_atto")),
        RealModel("timm_vit_tiny", "timm", _timm("vit_tiny_patch16_224", img_size=64)),
        RealModel("timm_resnet10t", "timm", _timm("resnet10t")),
        RealModel("diffusers_unet2d", "diffusers", _unet2d),
        RealModel("diffusers_unet2d_condition", "diffusers", _unet2d_condition),
    )
}
"""Every real model by name. The language models use one key/value head per query head (see
:data:`LLAMA_GQA`)."""

LLAMA_GQA = RealModel("hf_llama_gqa", "transformers", _hf_llama_gqa)
"""Llama with grouped-query attention (2 key/value heads for 4 query heads): transformers repeats
k and v (``repeat_kv``: expand + reshape) in the low dtype, and torch.compile's gradients of k and
v then differ from eager's in low precision, with or without amp_fx (tests/models)."""

LLAMA_4_LAYERS = RealModel("hf_llama_4_layers", "transformers", _hf_llama_4_layers)
"""Llama with 4 decoder blocks (``model.layers.0`` to ``.3``): a first and a last block with two
between them, for the per-module low-precision map (tests/fp8/test_recipe_per_module.py)."""

GEMMA3_SLIDING = RealModel("hf_gemma3_sliding", "transformers", _hf_gemma3)
"""Gemma 3 with grouped-query attention (2 key/value heads for 4) and sliding-window layers only,
the window (8) shorter than the sequence (16): eager builds the mask too and repeats k/v as the
trace does, so amp_fx is bitwise and nothing is reported (tests/models)."""

GEMMA3_FULL_LAYER = RealModel("hf_gemma3_full_layer", "transformers", _hf_gemma3_full_layer)
""":data:`GEMMA3_SLIDING` with its second layer full attention (every sixth layer of the released
Gemma 3 models): eager drops that layer's plain causal mask and calls sdpa with ``enable_gqa``,
the trace repeats k/v, as Llama's (tests/models)."""


# --- running one step -----------------------------------------------------------------------------


def output_tensors(out: Any) -> dict[str, Tensor]:
    """Every tensor of a model's output by its path (``['logits']``, ``.sample``, ``''`` for a lone
    tensor), detached: ``ModelOutput`` dicts, dataclasses and tuples alike."""
    if isinstance(out, dict):  # ModelOutput, BaseOutput: dicts whose pytree registration has no keys
        out = dict(out.items())
    return {keystr(path): t.detach() for path, t in tree_flatten_with_path(out)[0] if isinstance(t, Tensor)}


@dataclass
class RealStep:
    """What one forward+backward left behind: the output tensors, the loss, every ``.grad``,
    every buffer."""

    out: dict[str, Tensor]
    loss: Tensor
    grads: dict[str, Tensor | None]
    buffers: dict[str, Tensor]


def _collect(model: nn.Module, out: Any, loss: Tensor) -> RealStep:
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return RealStep(output_tensors(out), loss.detach(), grads, buffers)


def eager_autocast_real_step(
    model: nn.Module, inputs: dict[str, Tensor], loss_fn: LossFn, dtype: torch.dtype
) -> RealStep:
    """The reference: ``with torch.autocast("cpu", dtype): loss = loss_fn(model(**inputs))``, then
    ``loss.backward()`` outside the region, as torch's AMP recipe does."""
    with torch.autocast("cpu", dtype=dtype):
        out = model(**inputs)
        loss = loss_fn(out)
    loss.backward()
    return _collect(model, out, loss)


def real_step(run: Callable[..., Any], model: nn.Module, inputs: dict[str, Tensor], loss_fn: LossFn) -> RealStep:
    """One forward+backward through ``run`` (an amp_fx-compiled module) with no ambient autocast;
    grads and buffers are read from ``model``, which ``run`` shares its state with."""
    out = run(**inputs)
    loss = loss_fn(out)
    loss.backward()
    return _collect(model, out, loss)
