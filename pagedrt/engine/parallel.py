"""The model runner tensor-parallel over a :class:`~pagedrt.shard.ShardedKVCache`: Megatron's cut of a Llama layer.

Each shard runs :class:`~pagedrt.engine.model.LlamaModel`'s launches on its device over its
share of the weights (:func:`shard_weights`; weights are ``[out, in]``): the query, key and
value rows of its heads (its KV heads and their query heads, as the cache's shard holds
them), the output projection's input columns of those query heads, the gate and up rows of
its share of the SwiGLU width, and the down projection's input columns of that share; norms, the embedding and the output
projection are whole on every shard. A layer's attention and MLP then need no exchange but
one sum each: the output and down projections' partial results are all-reduced over the
shards (:class:`AllReduce`) before the residual add, so every shard keeps the same residual
stream, and shard 0's logits are the step's.

The sum is NCCL's all-reduce (``cupy.cuda.nccl``) for shards on distinct devices. Shards that
share one device (how the tests run on one GPU) add on that device, and on the host backend
NumPy adds. Decode steps run eagerly and layered (no CUDA graphs, no one-launch step: its sums are
the all-reduces between launches).
"""

from dataclasses import dataclass, replace
from typing import List, Sequence, Tuple

import numpy as np

from .. import kernels
from ..errors import BackendUnavailableError, CommunicatorError, ShardError
from ..shard import ShardedKVCache, ShardedStep, peer_copy
from ..spec import Array
from .config import ModelConfig
from .loader import GGUFModel, Weights
from .model import LlamaModel

REDUCED = ("gemm_o", "gemm_down")  # the launches whose outputs are partial sums over the shards


def shard_weights(weights: Weights, config: ModelConfig, shards: int) -> Tuple[List[Weights], ModelConfig]:
    """The :class:`~pagedrt.engine.loader.Weights` of each of ``shards`` shards (NumPy, views where they can be),
    and the config each runs with (its query and KV heads and SwiGLU width). ShardError unless the query heads,
    KV heads and SwiGLU width divide among the shards."""
    c, n = config, shards
    if c.kv_heads % n or c.q_heads % n or c.ffn % n:
        raise ShardError(f"{n} shards cannot split {c.q_heads} query heads, {c.kv_heads} KV heads and a SwiGLU "
                         f"width of {c.ffn} evenly: each must be a multiple of {n}")
    d, hq, hk, f = c.head_dim, c.q_heads // n, c.kv_heads // n, c.ffn // n
    q_end, k_end = c.q_heads * d, (c.q_heads + c.kv_heads) * d
    out = []
    for s in range(n):
        layers = []
        for w in weights.layers:
            qkv = w["qkv"]  # [out, in]: a shard's heads are rows
            rows = np.concatenate([qkv[s * hq * d:(s + 1) * hq * d], qkv[q_end + s * hk * d:q_end + (s + 1) * hk * d],
                                   qkv[k_end + s * hk * d:k_end + (s + 1) * hk * d]])
            gate_up = np.concatenate([w["gate_up"][s * f:(s + 1) * f], w["gate_up"][c.ffn + s * f:c.ffn + (s + 1) * f]])
            layers.append({"attn_norm": w["attn_norm"], "ffn_norm": w["ffn_norm"], "qkv": rows,
                           "o": w["o"][:, s * hq * d:(s + 1) * hq * d], "gate_up": gate_up,
                           "down": w["down"][:, s * f:(s + 1) * f]})
        out.append(replace(weights, layers=layers))
    return out, replace(config, q_heads=hq, kv_heads=hk, ffn=f)


@dataclass(frozen=True)
class _ShardModel:
    """What LlamaModel reads of a model: its config and weights (a shard's)."""
    config: ModelConfig
    weights: Weights


class AllReduce:
    """Sums arrays of the same shape, one per shard, into every one of them, in place.

    ``devices``: the shards' devices, in shard order; ``host``: the arrays are NumPy arrays
    (the host backend, where the devices are labels). Distinct devices use an NCCL
    communicator over them (:class:`~pagedrt.errors.BackendUnavailableError` if
    ``cupy.cuda.nccl`` is not there), each rank's sum queued on its device's current stream;
    one device shared by every shard adds there, on its current stream. Devices that repeat
    but are not all one are a :class:`~pagedrt.errors.CommunicatorError`: NCCL takes one rank
    a device.
    """

    def __init__(self, devices: Sequence[int], host: bool = False) -> None:
        self.devices, self.comm = list(devices), None
        if host or len(set(self.devices)) == 1:
            return
        if len(set(self.devices)) != len(self.devices):
            raise CommunicatorError(f"devices {self.devices}: an NCCL communicator takes one rank a device, and "
                                    f"shards sharing a device must all share one")
        try:
            from cupy.cuda import nccl
        except ImportError as exc:
            raise BackendUnavailableError(f"NCCL is not available to CuPy ({exc}): install NCCL (for instance "
                                          f"nvidia-nccl-cu13) to reduce over several GPUs") from None
        self.nccl = nccl
        self.comm = nccl.NcclCommunicator.initAll(self.devices)

    def __call__(self, arrays):
        if len(arrays) != len(self.devices):
            raise CommunicatorError(f"{len(arrays)} arrays for a sum over {len(self.devices)} ranks")
        if self.comm is None:
            total = arrays[0].copy()
            for a in arrays[1:]:
                total += a
            for a in arrays:
                a[...] = total
            return
        import cupy
        nccl = self.nccl
        kinds = {"float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32,
                 "bfloat16": getattr(nccl, "NCCL_BFLOAT16", None)}  # bfloat16: NCCL 2.10 and later
        kind = kinds.get(arrays[0].dtype.name)
        if kind is None:
            raise CommunicatorError(f"this NCCL cannot sum {arrays[0].dtype} arrays")
        nccl.groupStart()
        for comm, a, device in zip(self.comm, arrays, self.devices):
            with cupy.cuda.Device(device):
                comm.allReduce(a.data.ptr, a.data.ptr, a.size, kind, nccl.NCCL_SUM, cupy.cuda.get_current_stream().ptr)
        nccl.groupEnd()


class TensorParallelModel:
    """A Llama-family model run tensor-parallel over a :class:`~pagedrt.shard.ShardedKVCache` (module docstring).

    :meth:`forward` takes the :class:`~pagedrt.shard.ShardedStep` that ``cache.step()`` returns
    and the step's new token ids (shard 0's device), and returns shard 0's logits; run it on
    :attr:`stream` (a stream of shard 0's device; on the host backend, nothing), as
    :class:`~pagedrt.engine.model.LlamaModel`'s forward.
    """

    def __init__(self, model: GGUFModel, cache: ShardedKVCache) -> None:
        self.cache, self.config = cache, model.config
        parts, config = shard_weights(model.weights, model.config, len(cache.shards))
        self.shards = []
        for shard, weights in zip(cache.shards, parts):
            with shard.device_context():
                self.shards.append(LlamaModel(_ShardModel(config, weights), shard, graphs=False, fused=False))
        self.reduce = AllReduce([s.device for s in cache.shards], host=cache.shards[0].xp is np)
        self.stream = self.shards[0].stream  # shard 0's model's

    def forward(self, step: ShardedStep, ids: Array) -> Array:
        """Logits (float32 [batch, vocab] on shard 0's device) of each batch row's last new token."""
        steps = getattr(step, "shards", ())
        if len(steps) != len(self.shards):
            raise ShardError(f"a step of {len(steps)} shards for a model of {len(self.shards)}: pass what this "
                             f"cache's step() returns")
        runs = []
        for shard, model, part in zip(self.cache.shards, self.shards, steps):
            with shard.device_context():
                if len(part.copies):
                    kernels.copy_blocks(shard.planes, part.copies)
                own = ids
                if shard.xp is not np and ids.device.id != shard.device:  # ids to this shard's device
                    own = shard.xp.empty_like(ids)
                    peer_copy([(own, ids)], ids.device.id, shard.device)
                decode = part.num_tokens == len(part.seqs)
                buffers = model.buffers(part.num_tokens, len(part.seqs))
                runs.append((buffers, model.launches(part, own, buffers, *model.plans(part, buffers, decode))))
        for launches in zip(*(run for _, run in runs)):
            for shard, (kind, launch) in zip(self.cache.shards, launches):
                with shard.device_context():
                    launch()
            if launches[0][0] in REDUCED:
                self.reduce([buffers["delta"] for buffers, _ in runs])
        return runs[0][0]["logits"]
