"""The reference DiT split across ranks: tensor parallel and sequence parallel.

``ParallelDiTWorker`` is ``DiTPipelineWorker`` (``omni_async.models.dit``) with its
denoiser split over the ranks of the executor's process group (``DistContext``, from
``WorkerSpec(..., pass_dist=True)`` on an executor with ``process_group=True``):

* ``mode="tensor"`` (Megatron-style): each rank holds ``heads / world_size`` attention
  heads of every attention layer (their rows of ``qkv``, their columns of ``proj``) and
  ``hidden / world_size`` units of every MLP (rows of ``fc1``, columns of ``fc2``).  A
  branch's partial outputs are summed with one all-reduce, then the branch's bias is
  added once: one all-reduce per attention and one per MLP of every block.
* ``mode="sequence"`` (Ulysses-style): each rank holds every weight and
  ``patches / world_size`` tokens of every frame.  Around spatial attention, an
  all-to-all trades "my tokens, every head" for "every token, my heads" and back;
  temporal attention (over the frames at one patch position), the MLPs and the
  modulations are token-wise, so they run on the rank's tokens alone; one all-gather
  collects the velocities at the end.  A request whose patches per frame do not divide
  by the world size fails with ``InvalidRequest`` on every rank, before any collective.

Same weights on every rank: each rank builds the whole model from ``seed`` (exactly as
the unsplit ``DiTPipelineWorker`` does) and keeps its slice, so a split model's output
equals the unsplit one's up to float rounding (the sums run in another order): within
``PARALLEL_ATOL`` on float32 pixels in [0, 1] (measured: about 1e-6 on the CPU).

Only the reply rank's output is shipped; the other ranks skip the decoder (its input is
the same on every rank, its output would be discarded) and answer with an empty output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from omni_async.core.errors import InvalidRequest, UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.models.dit import (
    DECODER_FACTOR,
    PATCH_SIZE,
    DiTPipelineWorker,
    _Attention,
    _Block,
    _Denoiser,
    block_forward,
)
from omni_async.worker.dist import DistContext

__all__ = ["PARALLEL_ATOL", "ParallelDiTWorker", "ParallelMode", "make_worker"]

ParallelMode = Literal["tensor", "sequence"]
#: The largest difference between a split model's float32 pixels and the unsplit model's.
PARALLEL_ATOL = 1e-4


def _blocks(denoiser: _Denoiser) -> list[_Block]:
    """The denoiser's blocks, typed (``nn.ModuleList`` yields plain modules)."""
    blocks = [b for b in denoiser.blocks if isinstance(b, _Block)]
    assert len(blocks) == len(denoiser.blocks)
    return blocks


def _all_reduce(x: Tensor, ctx: DistContext) -> Tensor:
    dist.all_reduce(x, group=ctx.group)
    return x


# --------------------------------------------------------------------------- tensor parallel


class _TPAttention(nn.Module):
    """This rank's heads of an ``_Attention``: partial projections, summed across ranks."""

    def __init__(self, full: _Attention, ctx: DistContext) -> None:
        super().__init__()
        dim = full.qkv.in_features
        head_dim = dim // full.heads
        self.local_heads = full.heads // ctx.world_size
        self.ctx = ctx
        mine = slice(ctx.rank * self.local_heads, (ctx.rank + 1) * self.local_heads)
        w = full.qkv.weight.detach().view(3, full.heads, head_dim, dim)[:, mine].reshape(-1, dim)
        b = full.qkv.bias.detach().view(3, full.heads, head_dim)[:, mine].reshape(-1)
        self.qkv_weight = nn.Parameter(w.clone(), requires_grad=False)
        self.qkv_bias = nn.Parameter(b.clone(), requires_grad=False)
        cols = slice(mine.start * head_dim, mine.stop * head_dim)
        self.proj_weight = nn.Parameter(full.proj.weight.detach()[:, cols].clone(), requires_grad=False)
        self.proj_bias = nn.Parameter(full.proj.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        hd = d // (self.local_heads * self.ctx.world_size)
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.view(b, n, 3, self.local_heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, self.local_heads * hd)
        return _all_reduce(F.linear(o, self.proj_weight), self.ctx) + self.proj_bias


class _TPBlock(nn.Module):
    """A ``_Block`` with its attentions and MLP split by heads and hidden units."""

    def __init__(self, full: _Block, ctx: DistContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.modulation = full.modulation  # replicated: every rank needs every gate
        self.spatial = _TPAttention(full.spatial, ctx)
        self.temporal = _TPAttention(full.temporal, ctx)
        hidden = full.fc1.out_features // ctx.world_size
        mine = slice(ctx.rank * hidden, (ctx.rank + 1) * hidden)
        self.fc1_weight = nn.Parameter(full.fc1.weight.detach()[mine].clone(), requires_grad=False)
        self.fc1_bias = nn.Parameter(full.fc1.bias.detach()[mine].clone(), requires_grad=False)
        self.fc2_weight = nn.Parameter(full.fc2.weight.detach()[:, mine].clone(), requires_grad=False)
        self.fc2_bias = nn.Parameter(full.fc2.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        # ``_Block``'s arithmetic (``block_forward``), each branch summed across ranks.
        return block_forward(x, cond, self.modulation, self.spatial, self.temporal, self.mlp)

    def mlp(self, h: Tensor) -> Tensor:
        part = F.linear(F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias)), self.fc2_weight)
        out: Tensor = _all_reduce(part, self.ctx) + self.fc2_bias
        return out


class _TensorParallelDenoiser(nn.Module):
    def __init__(self, full: _Denoiser, ctx: DistContext) -> None:
        super().__init__()
        self.full = full  # embeddings and head, replicated
        self.blocks = nn.ModuleList([_TPBlock(blk, ctx) for blk in _blocks(full)])
        full.blocks = nn.ModuleList()  # the unsplit blocks' weights go

    def forward(self, z: Tensor, sigma: Tensor) -> Tensor:
        x, cond, grid = self.full.tokens(z, sigma)
        for block in self.blocks:
            x = block(x, cond)
        return _Denoiser.velocity(self.full.head(x, cond), grid)


# --------------------------------------------------------------------------- sequence parallel


def _all_to_all(x: Tensor, ctx: DistContext) -> Tensor:
    """``x: [world, ...]``: chunk r goes to rank r; returns chunk r of every rank, in rank order."""
    x = x.contiguous()  # first: ``empty_like`` keeps a permuted view's strides, the collective does not
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=ctx.group)
    return out


class _SequenceParallelDenoiser(nn.Module):
    def __init__(self, full: _Denoiser, ctx: DistContext) -> None:
        super().__init__()
        self.full = full
        self.ctx = ctx

    def forward(self, z: Tensor, sigma: Tensor) -> Tensor:
        ctx = self.ctx
        x, cond, grid = self.full.tokens(z, sigma)
        n = x.shape[2]
        if n % ctx.world_size:
            raise UsageError(f"{n} patches per frame do not split across {ctx.world_size} ranks")  # checked earlier
        local = n // ctx.world_size
        x = x[:, :, ctx.rank * local : (ctx.rank + 1) * local]
        for block in _blocks(self.full):
            x = self._block(block, x, cond)
        out = self.full.head(x, cond).contiguous()
        parts = [torch.empty_like(out) for _ in range(ctx.world_size)]
        dist.all_gather(parts, out, group=ctx.group)
        return _Denoiser.velocity(torch.cat(parts, dim=2), grid)

    def _block(self, blk: _Block, x: Tensor, cond: Tensor) -> Tensor:
        # ``_Block``'s arithmetic on this rank's tokens; only spatial attention needs the
        # others' (temporal attention runs over the frames at each of my patch positions).
        return block_forward(
            x, cond, blk.modulation, functools.partial(self._spatial, blk.spatial), blk.temporal, blk.mlp
        )

    def _spatial(self, attn: _Attention, h: Tensor) -> Tensor:
        """Attention over every token of a frame, this rank holding ``h: [bt, n_local, D]``."""
        ws = self.ctx.world_size
        bt, nl, d = h.shape
        heads, hl = attn.heads, attn.heads // ws
        hd = d // heads
        qkv = attn.qkv(h).view(bt, nl, 3, ws, hl, hd)  # heads grouped by the rank that takes them
        # Send head group r to rank r; receive every rank's tokens for my heads.
        got = _all_to_all(qkv.permute(3, 0, 1, 2, 4, 5), self.ctx)  # [ws (token block), bt, nl, 3, hl, hd]
        q, k, v = got.permute(1, 0, 2, 3, 4, 5).reshape(bt, ws * nl, 3, hl, hd).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # [bt, n, hl, hd]
        # Back: token block r to rank r, which gets every head group for its tokens.
        back = _all_to_all(
            o.reshape(bt, ws, nl, hl, hd).permute(1, 0, 2, 3, 4), self.ctx
        )  # [ws (heads), bt, nl, hl, hd]
        o = back.permute(1, 2, 0, 3, 4).reshape(bt, nl, d)
        out: Tensor = attn.proj(o)
        return out


# --------------------------------------------------------------------------- the worker


class ParallelDiTWorker(DiTPipelineWorker):
    """``DiTPipelineWorker`` split across the ranks of ``dist`` (see the module docstring).

    ``mode``: ``"tensor"`` or ``"sequence"``; ``dist``: this rank's ``DistContext`` (None:
    the unsplit model, one rank); the other keyword arguments are
    ``DiTPipelineWorker``'s, the same on every rank (``seed`` above all).  ``heads`` must
    divide by the world size, and in tensor mode the MLP's hidden size too.
    """

    def __init__(self, *, mode: ParallelMode = "tensor", dist: DistContext | None = None, **kwargs: Any) -> None:
        if mode not in ("tensor", "sequence"):
            raise UsageError(f"ParallelDiTWorker: mode must be 'tensor' or 'sequence', got {mode!r}")
        if dist is not None:
            kwargs["device"] = dist.device
        super().__init__(**kwargs)
        self.mode: ParallelMode = mode
        self.dist = dist
        if dist is None or dist.world_size == 1:
            return
        first = _blocks(self.denoiser)[0]  # depth >= 1
        heads, hidden = first.spatial.heads, first.fc1.out_features
        if heads % dist.world_size or (mode == "tensor" and hidden % dist.world_size):
            raise UsageError(
                f"ParallelDiTWorker: heads ({heads}) and, in tensor mode, the MLP's hidden size ({hidden}) must "
                f"divide by the world size ({dist.world_size})"
            )
        split = _TensorParallelDenoiser if mode == "tensor" else _SequenceParallelDenoiser
        self.denoiser = split(self.denoiser, dist).eval()  # type: ignore[assignment]  # the same forward

    def validate_split(self, request: DiffusionRequest) -> None:
        """Sequence mode: the patches of a frame must divide by the world size."""
        if self.dist is None or self.mode != "sequence" or self.dist.world_size == 1:
            return
        p = request.params
        side = DECODER_FACTOR * PATCH_SIZE
        rows = -(-int(p.get("height", 128)) // side)
        cols = -(-int(p.get("width", 128)) // side)
        if (rows * cols) % self.dist.world_size:
            raise InvalidRequest(
                request.request_id,
                "height",
                f"and width give {rows}x{cols} patches per frame, which do not split across "
                f"{self.dist.world_size} ranks (sequence parallel): pick sizes whose patch count divides",
            )

    def _run(self, requests: Sequence[DiffusionRequest]) -> list[DiffusionOutput]:
        # Every rank refuses the same request before its first collective: none is left waiting.
        for r in requests:
            self.validate_split(r)
        return super()._run(requests)

    def decode(self, latents: Tensor) -> Tensor:
        """The reply rank decodes; the others' outputs are discarded, so they skip it."""
        if self.dist is None or self.dist.is_reply_rank:
            return super().decode(latents)
        b, t = latents.shape[:2]
        return latents.new_zeros(b, t, 3, 1, 1)


def make_worker(*, dist: DistContext | None = None, **kwargs: Any) -> ParallelDiTWorker:
    """``WorkerSpec("omni_async.models.parallel_dit:make_worker", {"mode": "tensor", ...},
    pass_dist=True)``: a ``ParallelDiTWorker`` on this rank's device."""
    return ParallelDiTWorker(dist=dist, **kwargs)


_validate: Callable[[DiffusionRequest], None] = DiTPipelineWorker.validate_request
# The executor runs it on every request in the caller's thread (``WorkerSpec.request_validator``).
make_worker.validate_request = _validate  # type: ignore[attr-defined]
