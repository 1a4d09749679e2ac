"""Pre-packed linear layers for x86 CPUs: the weights laid out once for oneDNN's matmul.

``torch.nn.functional.linear`` on a CPU re-packs the weight matrix into the GEMM kernel's
blocked layout on every call, and for one or a few input rows that copy is most of the
work. With the weights packed once, a decode step of the default model at 1K cached tokens
takes 41-43 ms instead of 58-61 ms, and verifying 7 draft tokens costs 1.28-1.34x a plain
step instead of 1.42-1.64x (two runs of ``python benchmarks/verify_cost.py --contexts 1024
--sizes 0 7``, with and without ``--no-prepack``; 2-core AMD EPYC, 2 threads).

:func:`prepack` swaps every float32 ``nn.Linear`` of a model for a :class:`PackedLinear`
in place. The module keeps its ``weight`` parameter (state dicts, tied embeddings and
training are unchanged) and holds the packed copy besides it, so it costs one more copy
of the linear weights in memory. Whether packing pays depends on the CPU and on how many
rows a call multiplies (on a 2-core Intel Xeon without AMX, plain kernels win for one or
two rows and for 64, packed ones from 4 to 32 rows), so a layer runs packed only for inputs
of ``min_rows`` to ``max_rows`` rows and plain otherwise; :func:`accel.calibration.calibrate.cost_table`
measures where packing wins and ``accel.load_model`` packs with that window. Call it once
after loading; ``model.generate`` and ``accel.generate`` then run the same kernels, so plain accel decoding still equals
``model.generate`` token for token. Results differ from the unpacked model only by float32
rounding (the kernels sum in another order).

:meth:`PackedLinear.from_weight` packs a plain matrix the same way, float32 or (on CPUs with
bf16 instructions) bfloat16: Medusa's draft heads use it for their blocks and their slice of
the output layer, which are called with one to a few rows per draft level.

It is a no-op where oneDNN is missing or the layer is not a float32 CPU layer, and the
module falls back to ``F.linear`` whenever its input or weight has moved (another device
or dtype) or gradients are needed.

:func:`split_linear` is a kernel for the fewest rows that, like :func:`transpose_weights`
below, costs no memory: it views each weight as its two halves of output features and
multiplies both by one ``torch.bmm``, so two threads each read half the matrix. Where
``F.linear`` of one row leaves a core mostly idle (an AMD EPYC Zen 3, AVX2 only, 2 threads), a
one-token pass of the default model took 43 ms split against 57 ms packed and 62 ms plain at
256 cached entries, 48 against 59 and 62 ms at 2K (fastest of 20 alternating passes; the
medians 49 / 65 / 70 and 60 / 71 / 75), while for 2 and 4 tokens packed kernels won (``python
benchmarks/linear_kernels.py --rows 1 2 4 --repeats 5 --passes --rounds 20 --cached 256
2048``). A :class:`PackedLinear` runs it for inputs of at most ``split_rows`` rows, ahead of
its packed window; the calibration measures it like the others and sets that prefix
(:attr:`accel.calibration.cost_model.CostTable.split_rows`).

:func:`transpose_weights` is another lever: it stores each linear weight [out, in]
column-major (the same values and shape, strides ``(1, out)``), so
``F.linear(x, W)`` multiplies ``x`` by a contiguous ``W.T`` instead of a transposed view, and
the BLAS takes another path. On the 2-core Intel Xeon without AMX (``accel calibrate``), a
verify pass of the default model over 256 cached entries took 51 / 58 / 66 / 88 ms for 4 / 8 /
16 / 32 query tokens stored so against 66 / 81 / 122 / 140 ms row-major (and 62 / 69 / 74 / 96 ms
packed), 39 against 37 ms for one token and 48 against 40 ms for two; a 2K-token prefill took
the same either way. Which layout wins is measured per machine like packing
(:attr:`accel.calibration.cost_model.CostTable.transposed`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["CHUNKED_MAX_ROWS", "PackedLinear", "bf16_native", "is_prepacked", "is_transposed", "packable_dtypes", "packed_rows", "packed_window",
           "prepack", "prepack_available", "prepack_supported", "row_chunk", "split_linear", "split_rows", "transpose_weights", "unprepack", "untranspose_weights"]

_ROWS_HINT = 8  # oneDNN picks the packed layout for this many rows; 1-16 rows all run fast in it


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_EXACT_ROWS = 32  # packed passes of up to this many rows run at their own size


def packed_rows(rows: int) -> int:
    """How many rows a packed pass of ``rows`` rows runs with: ``rows`` up to 32, above that
    rounded up to one of 16 sizes per doubling (at most 6.25% padding rows, zeros, dropped).

    oneDNN builds and caches a kernel, with memory of its own, for every input shape it
    meets (up to 1,024 of them), so passes of every length (a service's prefills, one per
    prompt length) kept building new ones. ``python benchmarks/packed_shapes.py`` on an AMD
    EPYC Zen 3: 300 passes of 250 distinct row counts from 33 to 700 through the default
    model's four decoder linear shapes grew the RSS by 775 MiB and took 5.4-6.4 s a round;
    bucketed to 65 row counts, by 167 MiB, 4.5-5.3 s a round."""
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)


_PACKABLE = (torch.float32, torch.bfloat16)
_supported: dict[torch.dtype, bool] = {}
_available: dict[torch.dtype, bool] = {}


def _probe_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32).to(dtype)  # [out 4, in 8]
    return w, torch.ones(3, 8, dtype=dtype)


def prepack_supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU have oneDNN's packed-linear ops for ``dtype`` (float32,
    or bfloat16 where oneDNN reports bf16 support) and they run, whatever numbers they give;
    checked once per dtype. :func:`prepack_available` also checks the numbers."""
    if dtype not in _supported:
        ok = False
        if dtype in _PACKABLE:
            try:
                if torch.backends.mkldnn.is_available() and (
                        dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
                    w, x = _probe_operands(dtype)
                    _packed_linear(x, _pack(w), None)
                    ok = True
            except (AttributeError, RuntimeError):
                ok = False
        _supported[dtype] = ok
    return _supported[dtype]


def prepack_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether accel packs ``dtype`` linear weights here: :func:`prepack_supported`, and the
    packed kernel agrees with ``F.linear`` on a 4 x 8 example (checked once per dtype); where
    it does not, layers stay plain."""
    if dtype not in _available:
        ok = prepack_supported(dtype)
        if ok:
            w, x = _probe_operands(dtype)
            ok = bool(torch.allclose(_packed_linear(x, _pack(w), None).float(), nn.functional.linear(x, w).float(),
                                     atol=1e-2 if dtype != torch.float32 else 1e-5))
        _available[dtype] = ok
    return _available[dtype]


_NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16 / AMX, Arm BF16


@functools.cache
def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16, AMX, or Arm's BF16), read
    from ``/proc/cpuinfo``; elsewhere (no such file) what oneDNN reports.

    oneDNN reports bf16 support from AVX-512 on, but without those instructions its kernels
    convert to float32 on the fly: on a 2-core Intel Xeon without them, the Medusa heads'
    bf16 vocabulary projection of 6 rows took 2.9 ms against 1.3 ms in float32."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.partition(":")[2].split() for line in fh
                          if line.split(":")[0].strip() in ("flags", "Features")), [])
        return bool(_NATIVE_BF16_FLAGS & set(flags))
    except OSError:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes of the CPU linear layers :func:`prepack` swaps: float32 where
    :func:`prepack_available`, and bfloat16 where this CPU multiplies it natively
    (:func:`bf16_native`: oneDNN's packed bf16 kernels, as Inductor's freezing uses them; without
    those instructions oneDNN converts on the fly) and the packed kernel agrees with
    ``F.linear``. On an AMD EPYC Zen 4 (avx512_bf16, 2 threads) the default model's bf16 output
    layer took 1.9-3.0 ms packed against 3.1-4.9 ms plain for 1-16 rows (``python
    benchmarks/linear_kernels.py --rows 1 2 8 16 --dtype bfloat16``); whether a whole model gains
    is measured by the calibration like float32's kernels."""
    out = [torch.float32] if prepack_available(torch.float32) else []
    if bf16_native() and prepack_available(torch.bfloat16):
        out.append(torch.bfloat16)
    return tuple(out)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one ``torch.bmm`` over the two halves of the output
    features. x: [..., in], weight: [out, in] (out even), bias: [out] or None -> [..., out].

    For one or a few rows, ``F.linear`` is a matrix-vector product that the BLAS may run on
    one core; the two halves of ``weight`` are two independent products, one per thread,
    and each reads half the weights (see the module docstring for what that gained on an AMD
    EPYC Zen 3). :mod:`accel.calibration.calibrate` measures it like the other kernels. The weight is only
    viewed, never copied; the sums are the same dot products in another order (float32
    rounding)."""
    rows = x.numel() // x.shape[-1]
    out_features, in_features = weight.shape
    halves = weight.view(2, out_features // 2, in_features)
    cols = x.reshape(rows, in_features).t().unsqueeze(0).expand(2, in_features, rows)
    out = torch.bmm(halves, cols).permute(2, 0, 1).reshape(rows, out_features)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


#: Passes of up to this many rows (verify passes: rows x draft nodes) run in chunks of a
#: layer's ``chunk_rows``; longer ones (prefills) in one call.
CHUNKED_MAX_ROWS = 1024
_CHUNKS = (64, 32, 16, 8, 4, 2)
_chunk_memo: dict[tuple, int] = {}


def row_chunk(layer: "PackedLinear") -> int:
    """The most rows (of 64, 32, ..., 2) that one call of ``layer``'s kernels may
    take while every row still gets, bit for bit, what a call with that row alone gives; 0
    (no chunking) for a float32 or non-CPU layer.

    Why: in bfloat16 a oneDNN matmul picks its blocking by the number of rows, and above
    some count a row's sums come out in another order. On a 2-core Intel Xeon with AMX (torch
    2.13) the default model's decoder and output layers gave every row its single-row result
    in calls of up to 32 rows and not above, so a verify pass of more
    tokens flipped greedy tokens against plain decoding whatever it was padded to. A layer
    therefore runs passes of up to :data:`CHUNKED_MAX_ROWS` rows in calls of at most this
    many rows, measured here once per process for each shape, window and thread count on
    random inputs (float32 layers are exact to rounding without it; see
    :mod:`accel.kernels.invariance`)."""
    w = layer.weight
    if w.dtype == torch.float32 or w.device.type != "cpu" or w.dim() != 2:
        return 0
    key = (tuple(w.shape), w.dtype, layer.min_rows, layer.max_rows, layer.split_rows, layer._packed is not None,
           torch.get_num_threads())
    if key not in _chunk_memo:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(_CHUNKS[0], layer.in_features, generator=gen).to(w.dtype)
        with torch.inference_mode():
            single = torch.cat([layer._rows(x[i : i + 1]) for i in range(len(x))])
            good = 1
            for m in range(2, len(x) + 1):
                if not torch.equal(layer._rows(x[:m]), single[:m]):
                    break
                good = m
        # a layer whose single rows already differ from pairs (another kernel for one row) cannot
        # be made invariant by chunking: left whole (accel.kernels.invariance then reports it; benchmarks/invariance_rows.py shows it)
        _chunk_memo[key] = max(c for c in _CHUNKS if c <= good) if good >= 2 else 0
    return _chunk_memo[key]


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight oneDNN packed once. x: [..., in] -> [..., out].

    ``weight`` and ``bias`` are the original parameters; the packed copy is a plain
    attribute (not a buffer), so ``.to()``, ``state_dict`` and ``parameters()`` see only the
    originals. A float32 or (on CPUs with bf16 instructions) bfloat16 CPU weight is packed;
    any other runs as ``F.linear``.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = 1, max_rows: int | None = None, split_rows: int = 0) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows, self.max_rows = _check_rows(min_rows, max_rows)
        self.split_rows = _check_split(split_rows)
        self._repack()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """A layer computing ``x @ weight.T + bias`` from plain tensors (weight [out, in],
        bias [out] or None, both kept by reference), for inference-only matrices such as
        draft heads' projections."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = int(weight.shape[1]), int(weight.shape[0])
        layer.weight, layer.bias = weight, bias
        layer.min_rows, layer.max_rows, layer.split_rows = 1, None, 0
        layer._repack()
        return layer

    def _repack(self) -> None:
        w = self.weight
        packable = w.device.type == "cpu" and w.dim() == 2 and prepack_available(w.dtype)
        self._packed_from = self._weight_key()
        self._packed = _pack(w) if packable else None
        self.chunk_rows = row_chunk(self)

    def refresh(self, force: bool = False) -> None:
        """Pack again if ``weight`` was replaced or modified in place since it was packed
        (e.g. by :func:`transpose_weights`), or always with ``force``; until a stale copy is
        packed again the layer runs ``F.linear``. An in-place change of an inference-tensor
        weight is not seen (see :meth:`_weight_key`): refresh with ``force`` after one."""
        if force or self._weight_key() != self._packed_from:
            self._repack()

    def __getstate__(self) -> dict:
        # the packed copy is an opaque oneDNN tensor that cannot be copied or pickled: drop it
        # and pack again on the other side (copy.deepcopy, pickle, torch.save of the module)
        return {k: v for k, v in self.__dict__.items() if k not in ("_packed", "_packed_from")}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("split_rows", 0)  # pickled before the split window existed
        self.__dict__.setdefault("chunk_rows", 0)
        self._repack()

    def _weight_key(self) -> tuple:
        """What identifies the packed weight's contents: storage, in-place version, dtype, device.

        Inference tensors (made under ``torch.inference_mode``) keep no version counter, so an
        in-place change of such a weight inside ``inference_mode`` goes unseen here (the layer
        would go on with the old packed copy until ``refresh(force=True)``). Outside
        ``inference_mode`` torch refuses in-place changes of inference tensors."""
        w = self.weight
        version = 0 if w.is_inference() else w._version
        return (w.data_ptr(), version, w.dtype, w.device)

    def _inference_input(self, x: torch.Tensor) -> bool:
        """Whether ``x`` may take an inference kernel: a CPU input of the weight's dtype (and
        the bias's), no gradients wanted."""
        w = self.weight
        return (
            x.is_cpu
            and x.dtype == w.dtype
            and (self.bias is None or self.bias.dtype == w.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        )

    def _usable(self, x: torch.Tensor) -> bool:
        # the cheap checks of the input first: this runs on every call of every layer
        return self._packed is not None and self._inference_input(x) and self._weight_key() == self._packed_from

    def _splittable(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (self.out_features % 2 == 0 and w.device.type == "cpu" and w.dtype == torch.float32
                and self._inference_input(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        chunk = self.chunk_rows
        if (rows <= _EXACT_ROWS and (not chunk or rows <= chunk) and self.split_rows < rows and self.min_rows <= rows
                and (self.max_rows is None or rows <= self.max_rows) and self._usable(x)):
            # a decode or verify pass: one packed call at its own size (what _rows would run)
            return _packed_linear(x, self._packed, self.bias)
        if chunk and chunk < rows <= CHUNKED_MAX_ROWS:
            flat = x.reshape(rows, self.in_features)
            out = torch.cat([self._rows(part) for part in flat.split(chunk)])
            return out.reshape(*x.shape[:-1], self.out_features)
        return self._rows(x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on ``x`` [..., in] in one kernel call (the one its window picks for that
        many rows)."""
        rows = x.numel() // self.in_features
        if rows <= self.split_rows and self._splittable(x):
            return split_linear(x, self.weight, self.bias)
        if rows < self.min_rows or (self.max_rows is not None and rows > self.max_rows) or not self._usable(x):
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        padded = packed_rows(rows)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        out = _packed_linear(flat, self._packed, self.bias)[:rows]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        split = f", split for rows <= {self.split_rows}" if self.split_rows else ""
        split += f", in chunks of {self.chunk_rows} rows" if self.chunk_rows else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " + (
            (f"packed for {self.min_rows}-{self.max_rows or 'any'} rows" if self._packed is not None else "not packed")) + split


def prepack(model: nn.Module, min_rows: int = 1, max_rows: int | None = None, split_rows: int = 0) -> nn.Module:
    """Swap each float32 (and, where :func:`packable_dtypes` has it, bfloat16) CPU ``nn.Linear``
    of ``model`` (output head included) for a
    :class:`PackedLinear` that runs packed for inputs of ``min_rows`` to ``max_rows`` rows
    (the defaults: always) and plain otherwise, in place, and return ``model``. Inputs of at
    most ``split_rows`` rows (default 0: none) run :func:`split_linear` instead, whatever the
    packed window says.

    A no-op where :func:`packable_dtypes` is empty; layers on another device or dtype are
    left alone (so are a quantized model's int8 / int4 layers, which are not ``nn.Linear``).
    Calling it again on a packed model only sets the windows of rows.
    """
    _check_rows(min_rows, max_rows)
    _check_split(split_rows)
    dtypes = packable_dtypes()
    if not dtypes:
        return model
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.min_rows, m.max_rows, m.split_rows = min_rows, max_rows, split_rows
            m.chunk_rows = row_chunk(m)
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in dtypes
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module, min_rows, max_rows, split_rows))
    return model


def _check_rows(min_rows: int, max_rows: int | None) -> tuple[int, int | None]:
    def whole(n) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1

    if not whole(min_rows):
        raise ValueError(f"min_rows must be an integer >= 1, got {min_rows!r}")
    if max_rows is not None and not (whole(max_rows) and max_rows >= min_rows):
        raise ValueError(f"max_rows must be None or an integer >= min_rows ({min_rows}), got {max_rows!r}")
    return min_rows, max_rows


def _check_split(split_rows: int) -> int:
    if not (isinstance(split_rows, int) and not isinstance(split_rows, bool) and split_rows >= 0):
        raise ValueError(f"split_rows must be an integer >= 0, got {split_rows!r}")
    return split_rows


def split_rows(model: nn.Module) -> int:
    """Up to how many rows ``model``'s packed layers run :func:`split_linear` (0: never, also
    for a model :func:`prepack` did not swap)."""
    return next((m.split_rows for m in model.modules() if isinstance(m, PackedLinear)), 0)


def is_prepacked(model: nn.Module) -> bool:
    """Whether :func:`prepack` swapped any layer of ``model``."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def packed_window(model: nn.Module) -> tuple[int, int | None] | None:
    """The rows ``(fewest, most)`` for which ``model``'s packed layers run packed (most None:
    no limit), or None for a model :func:`prepack` did not swap (or one packed nowhere)."""
    for m in model.modules():
        if isinstance(m, PackedLinear) and m._packed is not None:
            return m.min_rows, m.max_rows
    return None


def unprepack(model: nn.Module) -> nn.Module:
    """Undo :func:`prepack`: swap each :class:`PackedLinear` of ``model`` back for an
    ``nn.Linear`` holding the same ``weight`` and ``bias`` parameters, in place, and return
    ``model``. The packed copies are freed; ties and state dicts are unchanged."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    for name, module in targets:
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = module.in_features, module.out_features
        linear.weight = module.weight
        if module.bias is None:
            linear.register_parameter("bias", None)
        else:
            linear.bias = module.bias
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, linear)
    return model


# ---------------------------------------------------------------------------- weight layout


def _linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D CPU weights of ``model``'s linear layers (``nn.Linear`` and
    :class:`PackedLinear`), each once (a tied output layer shares the input embedding's)."""
    seen: dict[int, nn.Parameter] = {}
    for m in model.modules():
        if isinstance(m, (nn.Linear, PackedLinear)):
            w = m.weight
            if isinstance(w, nn.Parameter) and w.dim() == 2 and w.device.type == "cpu" and w.is_floating_point():
                seen.setdefault(id(w), w)
    return list(seen.values())


def _is_column_major(w: torch.Tensor) -> bool:
    return w.shape[0] > 1 and w.shape[1] > 1 and w.stride() == (1, w.shape[0])


def _relayout(model: nn.Module, column_major: bool) -> nn.Module:
    # outside inference mode even when called inside it (a calibration the engine starts): the
    # new storage must stay a normal tensor, which autograd and version counters still track
    with torch.inference_mode(False), torch.no_grad():
        for w in _linear_weights(model):
            if _is_column_major(w) != column_major:
                # .data keeps the Parameter object, so ties, optimisers and hooks still see it
                w.data = w.data.t().contiguous().t() if column_major else w.data.contiguous()
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.refresh()
    return model


def transpose_weights(model: nn.Module) -> nn.Module:
    """Store every CPU linear weight of ``model`` column-major, in place, and return
    ``model``: each ``weight`` [out, in] keeps its Parameter object, shape and values, with
    strides ``(1, out)``, so ``F.linear`` multiplies by a contiguous ``W.T``. No second copy is
    kept: the row-major tensors are freed (weights that were pages of a memory-mapped
    checkpoint become anonymous memory instead, and the file's pages reclaimable cache).

    An input embedding tied to the output layer is the same Parameter and is stored so too
    (its lookup then gathers strided rows: ~15 ms for 4K tokens of the default model).
    Results differ from row-major weights only by float rounding (another summation order).
    Packed layers are packed again. ``state_dict`` and ``save_pretrained`` see the same
    [out, in] tensors; :func:`untranspose_weights` undoes it."""
    return _relayout(model, column_major=True)


def untranspose_weights(model: nn.Module) -> nn.Module:
    """Undo :func:`transpose_weights`: every CPU linear weight contiguous (row-major) again,
    in place; returns ``model``."""
    return _relayout(model, column_major=False)


def is_transposed(model: nn.Module) -> bool:
    """Whether :func:`transpose_weights` stored ``model``'s linear weights column-major."""
    return any(_is_column_major(w) for w in _linear_weights(model))
