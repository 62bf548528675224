"""Named errors. Each message says what was wrong and what to do about it.

Every error derives from :class:`PagedRTError` and from the built-in class that
fits it (``ValueError``, ``KeyError``, ``MemoryError`` ...), so callers can catch
either. An operation that raises leaves the object it was called on unchanged.
"""


class PagedRTError(Exception):
    """Base class of every error pagedrt raises on purpose."""


# --- backends and the driver -------------------------------------------------

class BackendUnavailableError(PagedRTError, RuntimeError):
    """The requested backend cannot run here (no driver, no device, no cupy)."""


class CudaError(PagedRTError, RuntimeError):
    """A CUDA driver call returned an error.

    Attributes
    ----------
    call : str
        The driver function (``"cuMemCreate"``).
    name, text : str
        The CUresult's name (``"CUDA_ERROR_OUT_OF_MEMORY"``) and description.
    """

    def __init__(self, call, name, text):
        self.call, self.name, self.text = call, name, text
        super().__init__(f"{call} failed: {name}: {text}")


class DeviceOutOfMemoryError(CudaError, MemoryError):
    """The device refused to allocate physical memory."""


class HostOutOfMemoryError(PagedRTError, MemoryError):
    """The host refused pinned memory for a host-tier chunk (``cuMemCreate`` at a host location)."""


# --- the pool (hardware layer) -----------------------------------------------

class PoolSizeError(PagedRTError, ValueError):
    """A size is non-positive or not a whole number of pages / chunks."""


class ReservationExceededError(PagedRTError, MemoryError):
    """A grow would map chunks past the end of the reserved range."""


class UnknownChunkError(PagedRTError, IndexError):
    """A chunk index outside the reservation."""


class ChunkStateError(PagedRTError, ValueError):
    """A chunk is not in the state the operation needs (released twice, mapped twice...)."""


class UnmappedRangeError(PagedRTError, ValueError):
    """A view asked for bytes that are not all mapped."""


class PoolClosedError(PagedRTError, RuntimeError):
    """The pool (or the cache over it) was closed; make a new one."""


class MappingLimitError(PagedRTError, MemoryError):
    """The address space refused a mapping: another one past the OS limit (``vm.max_map_count`` on Linux),
    or a reservation larger than the process or the device can address."""


# --- blocks, sequences and the cache (software layer) -------------------------

class PoolExhaustedError(PagedRTError, MemoryError):
    """Not enough free blocks even after growing the pool to its reservation."""


class HostTierExhaustedError(PagedRTError, MemoryError):
    """A swap-out needs more host-tier blocks than are free or hold only offloaded (evictable) cache blocks."""


class SwapStateError(PagedRTError, ValueError):
    """A sequence swapped out where it must be on the device (a fork, a second swap-out), or the reverse."""


class UnknownSequenceError(PagedRTError, KeyError):
    """A sequence id that was never added, or was already freed."""

    def __str__(self):  # KeyError would print the repr of the message
        return str(self.args[0])


class DuplicateSequenceError(PagedRTError, ValueError):
    """A sequence given twice where each may appear once (in one append, in one free)."""


class DoubleFreeError(PagedRTError, ValueError):
    """A block freed that is not held."""


class SequenceFullError(PagedRTError, ValueError):
    """An append would need more blocks than a block-table row holds."""


class TooManySequencesError(PagedRTError, ValueError):
    """Every row of the block table is taken."""


class InvalidTokenCountError(PagedRTError, ValueError):
    """A negative, non-integer or impossibly large token count."""


class InvalidTokenIdsError(PagedRTError, ValueError):
    """Token ids that are not a flat int array of the expected length with values in [0, 2**31)."""


class InvalidPositionError(PagedRTError, IndexError):
    """A token position outside a live sequence."""


class ConcurrentUseError(PagedRTError, RuntimeError):
    """Two threads changed one cache at the same time; a cache is not thread-safe."""


class UnsupportedConfigError(PagedRTError, ValueError):
    """A dtype, head_dim, block_size or shape that the cache or kernels do not support."""


# --- several GPUs ----------------------------------------------------------------

class PeerAccessError(PagedRTError, RuntimeError):
    """A device asked to reach another's memory that it cannot: no such device, or no peer access between the two."""


class CommunicatorError(PagedRTError, ValueError):
    """An NCCL communicator that does not fit the work: the wrong number of ranks, or ranks on other devices."""


class ShardError(PagedRTError, ValueError):
    """Shards that do not fit a sharded cache or model: KV heads (or query heads, or a SwiGLU width) that do not
    divide among them, no devices or ones that do not exist, a shard index out of range, or a step of another
    number of shards."""


# --- kernels ------------------------------------------------------------------

class LaunchArgumentError(PagedRTError, ValueError):
    """A kernel argument has the wrong shape, dtype, contiguity or device."""


class BlockTableError(PagedRTError, ValueError):
    """A block table, slot or pair names a block outside the planes or whose memory is not mapped, a length past
    a row's capacity, or a slot twice. Table and slot checks set attributes saying where: ``row``, ``length``,
    ``column``, ``block_id`` (tables), ``token``, ``slot``, ``first_token`` (slots)."""


# --- snapshots ----------------------------------------------------------------

class SnapshotError(PagedRTError, ValueError):
    """A snapshot file is missing, corrupt or of a schema this version cannot read."""


# --- the engine (pagedrt.engine) ---------------------------------------------------

class ModelFileError(PagedRTError, OSError):
    """A model file that is missing, unreadable, truncated or not a GGUF file, or that could not be fetched."""


class UnsupportedModelError(PagedRTError, ValueError):
    """A model whose architecture, shapes, tensor types or tokenizer the engine does not run."""


class RequestError(PagedRTError, ValueError):
    """A request the engine cannot serve: an empty prompt, one that with its tokens to generate does not fit in
    the cache, or sampling parameters out of range."""


class InvalidPromptError(RequestError):
    """A prompt that is not text the tokenizer can encode: a str with lone surrogates (bytes that were not UTF-8,
    as a command line in another encoding gives)."""
