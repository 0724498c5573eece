"""TransformerEngine's NVFP4 reference quantizer, transcribed (transformer_engine cannot be
installed without CUDA): the oracle of ``tests/fp8/test_nvfp4.py``.

Source: https://github.com/NVIDIA/TransformerEngine/blob/d0067d0da6cb01811b8072a7d304f0e00344ce2b/transformer_engine/pytorch/custom_recipes/reference_nvfp4.py
(commit d0067d0da6cb01811b8072a7d304f0e00344ce2b, 2026-08-22; Apache-2.0, Copyright (c) 2022-2026,
NVIDIA CORPORATION & AFFILIATES). Transcribed op for op: ``cast_to_fp4x2``, ``cast_from_fp4x2``,
``get_wgrad_sign_vector``, ``NVFP4QuantizerRef._build_hadamard_matrix``, ``_apply_rht``,
``_quantize_blockwise_reference``, ``_pad_tensor``, ``_rm_pad_tensor``, ``_quantize`` and the
NVFP4 branch of ``qgemm``, for the paths the ``NVFP4BlockScaling`` recipe takes (E4M3 block
scales, no 4over6, no row-scaled amax, no power-of-two scales). The quantizer's state is passed
as arguments instead of ``self``. TE's reference has no stochastic rounding (its kernels do it
in hardware): the tests check amp_fx's against this chain's scales and rounding neighbours.
"""

from __future__ import annotations

import torch


def cast_to_fp4x2(x):
    """Quantize a tensor to FP4 E2M1 and store in a byte tensor"""

    result = torch.zeros_like(x, dtype=torch.uint8)
    result[(x >= 0.0) & (x <= 0.25)] = 0
    result[(x > 0.25) & (x < 0.75)] = 1
    result[(x >= 0.75) & (x <= 1.25)] = 2
    result[(x > 1.25) & (x < 1.75)] = 3
    result[(x >= 1.75) & (x <= 2.5)] = 4
    result[(x > 2.5) & (x < 3.5)] = 5
    result[(x >= 3.5) & (x <= 5.0)] = 6
    result[x > 5.0] = 7

    result[(x >= -0.25) & (x < -0.0)] = 8
    result[(x < -0.25) & (x > -0.75)] = 9
    result[(x <= -0.75) & (x >= -1.25)] = 10
    result[(x < -1.25) & (x > -1.75)] = 11
    result[(x <= -1.75) & (x >= -2.5)] = 12
    result[(x < -2.5) & (x > -3.5)] = 13
    result[(x <= -3.5) & (x >= -5.0)] = 14
    result[x < -5.0] = 15

    return result[:, ::2] + result[:, 1::2] * 16


def cast_from_fp4x2(x, dq_dtype):
    """Dequantize FP4 E2M1 tensor that has been represented in a byte tensor"""
    fp4_values = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
        device=x.device,
        dtype=dq_dtype,
    )
    second_bit = torch.div(x, 16, rounding_mode="floor").to(torch.long)
    first_bit = (x - second_bit * 16).to(torch.long)
    first_bit_values = fp4_values[first_bit]
    second_bit_values = fp4_values[second_bit]
    result = torch.zeros((first_bit_values.shape[0], first_bit_values.shape[1] * 2), device=x.device, dtype=dq_dtype)
    result[:, ::2] = first_bit_values
    result[:, 1::2] = second_bit_values
    return result


def get_wgrad_sign_vector() -> torch.Tensor:
    """Hard-coded signs for Hadamard transform"""
    return torch.tensor(
        [1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0],
        dtype=torch.float32,
    )


def build_hadamard_matrix(size, device, dtype, with_random_sign_mask=True):
    """NVFP4QuantizerRef._build_hadamard_matrix (Sylvester construction)."""
    if (size & (size - 1)) != 0:
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones((1, 1), device=device, dtype=torch.float32)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    if with_random_sign_mask:
        sign_mat = get_wgrad_sign_vector().to(device) * torch.eye(size, device=device, dtype=torch.float32)
        h = sign_mat @ h
    return h.to(dtype)


def apply_rht(x, quant_tile_shape=(1, 16), with_random_sign_mask=True):
    """NVFP4QuantizerRef._apply_rht (with_rht=True)."""
    rht_dim = quant_tile_shape[1]
    if x.shape[-1] % rht_dim != 0:
        raise ValueError(f"Inner dimension {x.shape[-1]} must be divisible by hadamard dimension {rht_dim}")
    H = build_hadamard_matrix(rht_dim, x.device, x.dtype, with_random_sign_mask)
    scale = 1.0 / float(rht_dim) ** 0.5
    original_shape = x.shape
    x_mat = x.contiguous().view(-1, rht_dim)
    transform = H * scale
    out = x_mat @ transform
    return out.view(original_shape)


def quantize_blockwise_reference(x, global_amax, tile_len_x, tile_len_y):
    """NVFP4QuantizerRef._quantize_blockwise_reference, pow_2_scales=False, no 4over6, no row scaling."""
    if x.ndim != 2:
        raise ValueError(f"expects a 2D tensor, got {x.ndim}D with shape {x.shape}")
    using_2d_quantization = tile_len_x == 16 and tile_len_y == 16
    m, n = x.shape
    if using_2d_quantization:
        x_blocks = x.unfold(0, tile_len_y, tile_len_y).unfold(1, tile_len_x, tile_len_x).to(torch.float32)
        block_amax = torch.amax(torch.abs(x_blocks), dim=(-1, -2))
        vec_max = block_amax.repeat_interleave(tile_len_y, dim=0).unsqueeze(-1)
    else:
        x_reshaped = x.view(m, n // tile_len_x, tile_len_x)
        vec_max = torch.amax(torch.abs(x_reshaped), dim=-1, keepdim=True).to(torch.float32)
    x = x.view(m, n // tile_len_x, tile_len_x)
    FLOAT4_E2M1_MAX = torch.tensor(6.0, device=x.device, dtype=torch.float32)
    FLOAT8_E4M3_MAX = torch.tensor(448.0, device=x.device, dtype=torch.float32)
    GLOBAL_SCALE_E4M3_MAX = torch.tensor(448.0, device=x.device, dtype=torch.float32)

    global_encode_scale = torch.div(GLOBAL_SCALE_E4M3_MAX * FLOAT4_E2M1_MAX, global_amax)
    global_encode_scale = torch.min(
        global_encode_scale,
        torch.tensor(torch.finfo(torch.float32).max, device=global_encode_scale.device, dtype=torch.float32),
    )
    if global_encode_scale == torch.tensor(0.0, device=x.device, dtype=torch.float32):
        global_encode_scale = torch.tensor(1.0, device=x.device, dtype=torch.float32)
    global_decode_scale = torch.div(1.0, global_encode_scale)

    global_encode_scale_multiplier = global_encode_scale * torch.reciprocal(FLOAT4_E2M1_MAX)
    decode_scale = vec_max * global_encode_scale_multiplier
    decode_scale = torch.min(
        decode_scale,
        torch.tensor(torch.finfo(torch.float32).max, device=decode_scale.device, dtype=torch.float32),
    )
    decode_scale = torch.clamp(decode_scale, min=-FLOAT8_E4M3_MAX, max=FLOAT8_E4M3_MAX)
    decode_scale = decode_scale.to(torch.float8_e4m3fn)

    encode_scale = torch.min(
        torch.div(1.0, decode_scale.to(torch.float32) * global_decode_scale),
        torch.tensor(torch.finfo(torch.float32).max, device=decode_scale.device, dtype=torch.float32),
    )
    scaled_x = x.to(torch.float32) * encode_scale
    clipped_x = torch.clamp(scaled_x, -FLOAT4_E2M1_MAX, FLOAT4_E2M1_MAX).reshape(m, n)
    return cast_to_fp4x2(clipped_x), decode_scale.squeeze(-1)


def pad_tensor(tensor, row_divisor, col_divisor):
    """NVFP4QuantizerRef._pad_tensor."""
    M, N = tensor.shape
    padding_needed_rows = 0
    padding_needed_cols = 0
    if row_divisor is not None and M % row_divisor != 0:
        padding_needed_rows = row_divisor - (M % row_divisor)
    if col_divisor is not None and N % col_divisor != 0:
        padding_needed_cols = col_divisor - (N % col_divisor)
    if padding_needed_rows == 0 and padding_needed_cols == 0:
        return tensor
    return torch.nn.functional.pad(
        tensor, (0, padding_needed_cols, 0, padding_needed_rows), mode="constant", value=0.0
    ).contiguous()


def rm_pad_tensor(tensor, original_size):
    """NVFP4QuantizerRef._rm_pad_tensor."""
    M, N = original_size
    return tensor[:M, :N].contiguous()


def quantize(tensor, quant_tile_shape=(1, 16), with_rht=False):
    """NVFP4QuantizerRef._quantize (rowwise and columnwise usage, not row-scaled): returns
    ``(qx, sx, qx_t, sx_t, global_amax_row, global_amax_col)``. The Hadamard transform, where
    ``with_rht``, applies to the column-wise (transposed) copy only, as in TE."""
    if quant_tile_shape not in ((1, 16), (16, 16)):
        raise ValueError(f"NVFP4 only supports 1x16 or 16x16 tile shape, got {quant_tile_shape}")
    row_input = tensor
    col_input = apply_rht(tensor.t().contiguous(), quant_tile_shape) if with_rht else tensor.t().contiguous()
    global_amax_row = torch.max(torch.abs(row_input)).to(torch.float32).view(1)
    global_amax_col = torch.max(torch.abs(col_input)).to(torch.float32).view(1)

    M, N = tensor.shape
    x_padded = pad_tensor(row_input, row_divisor=quant_tile_shape[0], col_divisor=quant_tile_shape[1])
    qx, sx = quantize_blockwise_reference(x_padded, global_amax_row, quant_tile_shape[1], quant_tile_shape[0])
    qx = rm_pad_tensor(qx, (M, N // 2))

    x_t_padded = pad_tensor(col_input, row_divisor=quant_tile_shape[0], col_divisor=quant_tile_shape[1])
    qx_t, sx_t = quantize_blockwise_reference(x_t_padded, global_amax_col, quant_tile_shape[1], quant_tile_shape[0])
    qx_t = rm_pad_tensor(qx_t, (N, M // 2))
    return qx, sx, qx_t, sx_t, global_amax_row, global_amax_col


def qgemm(qx, qw, sx, sw, global_amax_x, global_amax_w, out_dtype, block_length=16):
    """The NVFP4 branch of NVFP4QuantizerRef.qgemm (no bias, no accumulation): ``x @ w.T`` as
    the FP4 tensor core computes it, per block of 16 in fp32, then times ``alpha``."""
    high_precision_x = cast_from_fp4x2(qx, out_dtype)
    high_precision_w = cast_from_fp4x2(qw, out_dtype)
    sx = sx.to(torch.float32)
    sw = sw.to(torch.float32)
    factor = 6.0 * 6.0 * 448.0 * 448.0
    alpha = torch.div((global_amax_x * global_amax_w).squeeze(-1), factor)
    M, K = high_precision_x.shape
    N, _ = high_precision_w.shape
    y = torch.zeros(M, N, dtype=torch.float32, device=qx.device)
    for k in range(K // block_length):
        k_start = k * block_length
        k_end = k_start + block_length
        qx_block = high_precision_x[:, k_start:k_end].clone().contiguous()
        qw_block = high_precision_w[:, k_start:k_end].clone().contiguous()
        y += torch.outer(sx[:, k], sw[:, k]) * (qx_block.to(torch.float32) @ qw_block.to(torch.float32).T)
    if K > 0:
        y = alpha * y
    return y.to(out_dtype)
