"""cuBLASLt's block-scaled FP8 matmul called directly, for products launched many at a time.

`torch._scaled_mm` with 1 x 128 activation scales and 128 x 128 weight scales runs one cuBLASLt
matmul, but each call builds a matmul descriptor, four matrix layouts and a preference, and asks
cuBLASLt's heuristic for an algorithm before it launches: 20-22 us of host time on an H200.
The experts of an FP8 MoE block make 2 x E such calls per layer (one per expert and product), and
at 128K tokens of Qwen3-30B-A3B the GPU finishes many of them faster than the host issues them
(docs/kernels.md). `Products` issues the same cuBLASLt matmul through ctypes with what does not
change kept between calls: one descriptor and handle per host thread, the layouts by shape, and
the heuristic's algorithm by (rows, N, K), asked once per new shape exactly as torch asks it
(one result, the same descriptor attributes and workspace limit), so each product runs the
kernel `torch._scaled_mm` would have run on it. A call then costs the host 12-13.5 us
(results/scale/logs/h200_s23_callABC_direct_cublaslt.txt, call C). The output is bf16, the
output dtype of this recipe in cuBLAS (`fp8_gemm._use_cublas`).

The operands follow `torch._scaled_mm(a, w.t(), a_scales, w_scales.t())` (see
`fp8_gemm.cublas_linear`): a [m, K] e4m3 rows, its scales [K / 128, m] group-major (m
contiguous), w [N, K] e4m3 with scales [N / 128, K / 128] in the layout cuBLAS reads
(`fp8_moe.cublas_weight_scales`), out [m, N] row-major; in cuBLAS's column-major terms that is
D (N x m) = op_T(w as K x N) times (a as K x m), weight scales `BLK128x128_32F` on A and
activation scales `VEC128_32F` on B.

The library is the libcublasLt that torch itself loaded. `available(device)` checks once per
device that cuBLASLt is new enough for block scaling (12.9) and that a small product equals
`torch._scaled_mm`'s bit for bit; where it does not, callers keep `torch._scaled_mm`.
RBS_BENCH_FP8_DIRECT_LT=0 keeps `torch._scaled_mm` everywhere (`in_use`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from ctypes import POINTER, Structure, byref, c_float, c_int, c_int64, c_size_t, c_uint64, c_void_p

import torch
from torch import Tensor

# From cublasLt.h, cublas_api.h and library_types.h (CUDA 12.9 and later); checked against the
# GPUs' CUDA 13.0 headers in results/scale/logs/h200_s23_callABC_direct_cublaslt.txt.
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_FAST_ACCUM = 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_VEC128_32F, SCALE_BLK128x128_32F = 4, 5
PREF_MAX_WORKSPACE_BYTES = 1
MIN_VERSION = 120900  # block-scaled FP8 on Hopper came with cuBLAS 12.9
WORKSPACE_BYTES = 32 << 20  # per stream; torch gives cuBLASLt 32 MiB on Hopper


class _Algo(Structure):
    _fields_ = [("data", c_uint64 * 8)]


class _Heuristic(Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", c_size_t),
        ("state", c_int),
        ("waves", c_float),
        ("reserved", c_int * 4),
    ]


def _loaded_path() -> str | None:
    """The path of the libcublasLt this process has mapped (torch links it), else None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        return None
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """torch's libcublasLt with the prototypes this module calls, or None where it is not found
    or older than `MIN_VERSION`."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    path = _loaded_path()
    if path is None:
        major = (torch.version.cuda or "0").split(".")[0]
        path = f"libcublasLt.so.{major}"
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    vp, pvp = c_void_p, POINTER(c_void_p)
    protos = {
        "cublasLtGetVersion": (c_size_t, []),
        "cublasLtCreate": (c_int, [pvp]),
        "cublasLtMatmulDescCreate": (c_int, [pvp, c_int, c_int]),
        "cublasLtMatmulDescSetAttribute": (c_int, [vp, c_int, vp, c_size_t]),
        "cublasLtMatrixLayoutCreate": (c_int, [pvp, c_int, c_uint64, c_uint64, c_int64]),
        "cublasLtMatmulPreferenceCreate": (c_int, [pvp]),
        "cublasLtMatmulPreferenceSetAttribute": (c_int, [vp, c_int, vp, c_size_t]),
        "cublasLtMatmulAlgoGetHeuristic": (
            c_int, [vp, vp, vp, vp, vp, vp, vp, c_int, POINTER(_Heuristic), POINTER(c_int)]
        ),
        "cublasLtMatmul": (
            c_int,
            [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, POINTER(_Algo), vp, c_size_t, vp],
        ),
    }  # fmt: skip
    for name, (restype, argtypes) in protos.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        fn.restype, fn.argtypes = restype, argtypes
    if lib.cublasLtGetVersion() < MIN_VERSION:
        return None
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} returned status {status}")


def _set(lib, setter, obj, attr: int, value) -> None:
    _check(setter(obj, attr, byref(value), ctypes.sizeof(value)), f"attribute {attr}")


class Products:
    """Block-scaled FP8 products of one weight shape [N, K] into bf16, issued straight to
    cuBLASLt (module docstring). Safe to use from several host threads at once: each thread has
    its own handle, descriptor and pointer cells, each stream its own workspace."""

    def __init__(self, device: torch.device, n: int, k: int):
        self.lib = library()
        if self.lib is None:
            raise RuntimeError("cuBLASLt with block-scaled FP8 (12.9 or newer) was not found")
        self.n, self.k = n, k
        self.device = torch.device(device)
        self._local = threading.local()
        self._layouts: dict[tuple, c_void_p] = {}
        self._algos: dict[int, tuple] = {}
        self._workspaces: dict[int, Tensor] = {}
        self._lock = threading.Lock()
        self.w_layout = self._layout(CUDA_R_8F_E4M3, k, n, k)

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> c_void_p:
        key = (dtype, rows, cols, ld)
        layout = self._layouts.get(key)
        if layout is None:
            layout = c_void_p()
            _check(self.lib.cublasLtMatrixLayoutCreate(byref(layout), *key), "layout")
            self._layouts[key] = layout
        return layout

    def _thread(self):
        state = getattr(self._local, "state", None)
        if state is None:
            lib = self.lib
            handle, desc, pref = c_void_p(), c_void_p(), c_void_p()
            _check(lib.cublasLtCreate(byref(handle)), "create")
            _check(
                lib.cublasLtMatmulDescCreate(byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc"
            )
            setter = lib.cublasLtMatmulDescSetAttribute
            for attr, value in (
                (DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T)),
                (DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N)),
                (DESC_FAST_ACCUM, ctypes.c_int8(0)),
                (DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_BLK128x128_32F)),
                (DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_VEC128_32F)),
            ):
                _set(lib, setter, desc, attr, value)
            _check(lib.cublasLtMatmulPreferenceCreate(byref(pref)), "preference")
            _set(lib, lib.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES,
                 c_uint64(WORKSPACE_BYTES))  # fmt: skip
            a_scale, b_scale = c_void_p(), c_void_p()
            state = (handle, desc, pref, a_scale, b_scale, c_float(1.0), c_float(0.0))
            self._local.state = state
        return state

    def _workspace(self, stream: torch.cuda.Stream) -> Tensor:
        ws = self._workspaces.get(stream.cuda_stream)
        if ws is None:
            with self._lock:
                ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
                self._workspaces[stream.cuda_stream] = ws
        return ws

    def _rows(self, state, m: int) -> tuple:
        """(a's layout, out's layout, the algorithm, its address) for m rows, made on first use:
        the heuristic's first answer, asked as `torch._scaled_mm` asks it (the descriptor holds
        the call's scale addresses by then)."""
        rows = self._algos.get(m)
        if rows is None:
            handle, desc, pref = state[:3]
            a_layout = self._layout(CUDA_R_8F_E4M3, self.k, m, self.k)
            d_layout = self._layout(CUDA_R_16BF, self.n, m, self.n)
            result, found = _Heuristic(), c_int(0)
            _check(self.lib.cublasLtMatmulAlgoGetHeuristic(
                handle, desc, self.w_layout, a_layout, d_layout, d_layout, pref, 1,
                byref(result), byref(found)), "heuristic")  # fmt: skip
            if found.value == 0:
                raise RuntimeError(
                    f"cuBLASLt: no block-scaled algorithm for {m} x {self.n} x {self.k}"
                )
            rows = self._algos[m] = (a_layout, d_layout, result, byref(result.algo))
        return rows

    def launch(self, calls, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue out = a @ w.T with the block scales for each (m, a, a_scales, w, w_scales, out)
        of `calls` (device addresses, as ints) on `stream` (default: the current one). m must be
        a multiple of 4, a and out row-major with K and N columns."""
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        state = self._thread()
        handle, desc, _, a_scale, b_scale, alpha, beta = state
        ws_ptr, raw_stream = self._workspace(stream).data_ptr(), stream.cuda_stream
        setter, matmul = self.lib.cublasLtMatmulDescSetAttribute, self.lib.cublasLtMatmul
        size, w_layout = ctypes.sizeof(c_void_p), self.w_layout
        a_ref, b_ref, alpha_ref, beta_ref = map(byref, (a_scale, b_scale, alpha, beta))
        by_rows, rows_of = self._algos, self._rows
        for m, a, a_s, w, w_s, out in calls:
            a_scale.value, b_scale.value = w_s, a_s
            setter(desc, DESC_A_SCALE_POINTER, a_ref, size)
            setter(desc, DESC_B_SCALE_POINTER, b_ref, size)
            a_layout, d_layout, _, algo = by_rows.get(m) or rows_of(state, m)
            status = matmul(
                handle, desc, alpha_ref, w, w_layout, a, a_layout, beta_ref, out, d_layout, out,
                d_layout, algo, ws_ptr, WORKSPACE_BYTES, raw_stream,
            )  # fmt: skip
            if status != 0:
                raise RuntimeError(
                    f"cuBLASLt matmul of {m} x {self.n} x {self.k} returned status {status}"
                )


@functools.cache
def products(device: torch.device, n: int, k: int) -> Products:
    """The `Products` of one device and shape, made once per process."""
    return Products(device, n, k)


def enabled() -> bool:
    return os.environ.get("RBS_BENCH_FP8_DIRECT_LT", "1") != "0"


def in_use(device: torch.device) -> bool:
    """Whether products on `device` go straight to cuBLASLt: `enabled` and `available`."""
    return enabled() and available(device)


@functools.cache
def available(device: torch.device) -> bool:
    """Whether this device's products go through `Products`: the library is there, and a small
    product equals `torch._scaled_mm`'s bit for bit."""
    if device.type != "cuda" or library() is None:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    m, n, k = 136, 512, 1024
    a = (torch.randn(m, k, generator=gen, device=device) * 4).to(torch.float8_e4m3fn)
    a_s = torch.rand(k // 128, m, generator=gen, device=device) / 64 + 1e-3
    w = (torch.randn(n, k, generator=gen, device=device) * 4).to(torch.float8_e4m3fn)
    w_s = torch.rand(n // 128, k // 128, generator=gen, device=device) / 64 + 1e-3
    with torch.cuda.device(device):
        want = torch._scaled_mm(a, w.t(), a_s.t(), w_s.t(), out_dtype=torch.bfloat16)
        got = torch.empty_like(want)
        try:
            products(device, n, k).launch(
                [(m, a.data_ptr(), a_s.data_ptr(), w.data_ptr(), w_s.data_ptr(), got.data_ptr())]
            )
        except RuntimeError:
            return False
        return bool(torch.equal(got, want))
