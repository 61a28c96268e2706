"""The CUDA mover (gcache/integrations/vllm/transfer/movers/cuda.py) and its native copy loop
(gcache_native/client/cuda_copy.cpp) without a GPU.

Here, in this process: the module imports without torch or CUDA, the copy method is chosen in
its order, bad descriptors are refused, `CudaMover()` says what it needs, and the native copy says
that no CUDA library is loaded. In a subprocess (process-marked): stand-in libcudart / libcuda
(a few lines of C built here, whose copies are memmoves) loaded the way torch loads the real ones,
and a stand-in torch, drive the whole mover: a group's pages gathered into its pinned staging and
scattered back into other blocks byte-exact, through the native loop and the native batch
(cuMemcpyBatchAsync asked for at the 12.8 ABI, stream order for device -> host, any order for
host -> device, the stream's context bound on a thread that had none). The real GPU run is
bench/gpu/gpu_check.sh.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gcache import _native
from gcache.integrations.vllm.transfer.movers import cuda
from tests.support import REPO_ROOT


def test_method_choice_follows_the_order_and_says_why_none_is_usable():
    usable = {"vllm": None, "native-batch": None, "native-loop": None, "cupy": None}
    assert cuda.choose_method("auto", usable) == "vllm"
    assert cuda.choose_method("auto", dict(usable, vllm="vLLM is not installed")) == "native-loop"
    # native-batch is never an automatic choice, only an asked-for one
    only_batch = {"vllm": "no", "native-batch": None, "native-loop": "no libcudart", "cupy": None}
    assert cuda.choose_method("auto", only_batch) == "cupy"
    assert cuda.choose_method("native-batch", only_batch) == "native-batch"
    with pytest.raises(cuda.CudaUnavailableError, match="native-loop: no libcudart; cupy: not installed"):
        cuda.choose_method("auto", dict(only_batch, cupy="not installed"))
    with pytest.raises(cuda.CudaUnavailableError, match="'native-loop' is not usable here: no libcudart"):
        cuda.choose_method("native-loop", only_batch)
    with pytest.raises(ValueError, match="one of vllm, native-batch, native-loop, cupy"):
        cuda.choose_method("memcpy", usable)


def test_descriptors_are_int64_of_one_length_and_empty_ranges_are_dropped():
    d, s, n = cuda.descriptors([10, 20, 30], np.array([1, 2, 3], np.uint64), [4, 0, 6])
    assert d.dtype == s.dtype == n.dtype == np.int64
    assert d.tolist() == [10, 30] and s.tolist() == [1, 3] and n.tolist() == [4, 6]
    with pytest.raises(ValueError, match="one length"):
        cuda.descriptors([1, 2], [1], [1, 1])
    with pytest.raises(ValueError, match="1-D"):
        cuda.descriptors(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="negative"):
        cuda.descriptors([1], [1], [-1])
    with pytest.raises(ValueError, match="null"):
        cuda.descriptors([0], [1], [1])


@pytest.mark.skipif("torch" in sys.modules, reason="torch is loaded in this process")
def test_without_a_gpu_the_mover_says_what_it_needs():
    with pytest.raises(cuda.CudaUnavailableError, match="needs .*(torch is not installed|CUDA device)"):
        cuda.CudaMover()
    with pytest.raises(ValueError, match="host_memory"):
        cuda.CudaMover(host_memory="paged")


def test_native_copy_without_cuda_loaded_says_so_and_checks_its_arguments():
    probe = _native.cuda_copy_probe()
    assert probe["loop"] is False and probe["batch"] is False and probe["libcudart"] is None
    one = np.array([1], np.uint64)
    with pytest.raises(RuntimeError, match=r"no CUDA runtime \(libcudart\) is loaded"):
        _native.cuda_copy_ranges(one, one, one, 7, "loop")
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync is not available"):
        _native.cuda_copy_ranges(one, one, one, 7, "batch")
    with pytest.raises(ValueError, match="one length"):
        _native.cuda_copy_ranges(one, np.array([1, 2], np.uint64), one, 7)
    with pytest.raises(ValueError, match="null address"):
        _native.cuda_copy_ranges(np.array([0], np.uint64), one, one, 7)
    with pytest.raises(ValueError, match="'loop' or 'batch'"):
        _native.cuda_copy_ranges(one, one, one, 7, "memcpy")


# -- the whole mover on stand-in CUDA libraries and a stand-in torch (subprocess) ---------

CUDART_STUB = r"""
#include <stddef.h>
#include <string.h>
static long calls; static void* last_stream;
int cudaMemcpyAsync(void* d, const void* s, size_t n, int kind, void* stream) {
  if (kind != 4) return 1;  /* cudaMemcpyDefault only */
  memmove(d, s, n); calls++; last_stream = stream; return 0;
}
const char* cudaGetErrorString(int code) { return "stub error"; }
long stub_calls(void) { return calls; }
void* stub_last_stream(void) { return last_stream; }
"""

CUDA_STUB = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
typedef struct { int order; int a, b, c, d; unsigned flags; } Attr;
static long calls, ranges; static int last_order, asked_version; static void* ctx; static void* last_stream;
static int batch(uint64_t* d, uint64_t* s, size_t* n, size_t count, Attr* attrs, size_t* idx, size_t nattrs,
                 size_t* fail, void* stream) {
  if (ctx != (void*)0x1234 || nattrs != 1 || idx[0] != 0) return 201;
  for (size_t i = 0; i < count; i++) memmove((void*)d[i], (const void*)s[i], n[i]);
  calls++; ranges += count; last_order = attrs[0].order; last_stream = stream; return 0;
}
int cuGetProcAddress_v2(const char* name, void** fn, int version, unsigned long long flags, int* status) {
  asked_version = version;
  if (strcmp(name, "cuMemcpyBatchAsync") == 0 && version == 12080) { *fn = (void*)batch; return 0; }
  *fn = 0; return 500;
}
int cuCtxGetCurrent(void** c) { *c = ctx; return 0; }
int cuStreamGetCtx(void* s, void** c) { *c = (void*)0x1234; return 0; }
int cuCtxSetCurrent(void* c) { ctx = c; return 0; }
int cuGetErrorName(int code, const char** s) { *s = "CUDA_ERROR_STUB"; return 0; }
long stub_calls(void) { return calls; }
long stub_ranges(void) { return ranges; }
int stub_last_order(void) { return last_order; }
int stub_asked_version(void) { return asked_version; }
void* stub_last_stream(void) { return last_stream; }
"""

# Runs in a subprocess: stand-in torch, stubs loaded as torch loads libcudart (RTLD_GLOBAL).
DRIVER = r"""
import contextlib, ctypes, importlib.machinery, itertools, json, sys, types
import numpy as np

cudart = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
libcuda = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)
for lib in (cudart, libcuda):
    lib.stub_last_stream.restype = ctypes.c_void_p

handles = itertools.count(0x5000)

class Stream:
    def __init__(self, device=None, priority=0):
        self.cuda_stream, self.priority, self.waited = next(handles), priority, []
    @staticmethod
    def priority_range():
        return (0, -5)
    def wait_event(self, event):
        self.waited.append(event)

class Event:
    def record(self, stream):
        self.stream = stream
    def query(self):
        return True
    def synchronize(self):
        pass

class Tensor:
    def __init__(self, array):
        self.array = array
    def data_ptr(self):
        return self.array.ctypes.data
    def numpy(self):
        return self.array

compute = Stream()
cuda = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: 0, Stream=Stream, Event=Event,
    device=lambda d: contextlib.nullcontext(),
    current_stream=lambda device=None: compute, get_device_name=lambda device=None: "stand-in",
    cudart=lambda: types.SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: 0),
)
torch = types.ModuleType("torch")
torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
torch.__dict__.update(
    __version__="stand-in", version=types.SimpleNamespace(cuda="13.0"), cuda=cuda, uint8=np.uint8,
    device=lambda kind, index=None: types.SimpleNamespace(type=kind, index=index),
    zeros=lambda *a, **k: None,
    empty=lambda n, dtype=None, pin_memory=False: Tensor(np.zeros(n, np.uint8)),
)
sys.modules["torch"] = torch

from gcache.integrations.vllm.transfer.movers.cuda import CudaMover
from gcache.integrations.vllm.transfer.page_runs import page_runs
from gcache.integrations.vllm.transfer.staging import StagingPool
from gcache.integrations.vllm.transfer.values import GroupValues
from tests.unit.test_vllm_page_runs_unit import View

out = {}
for method, host_memory in (("native-loop", "pinned"), ("native-batch", "registered")):
    mover = CudaMover(method=method, host_memory=host_memory)
    rng = np.random.default_rng(3)
    B, H, N, C = 9, 2, 4, 16
    kv = rng.integers(0, 255, (2, B, H, N, C), dtype=np.uint8)  # LBHNC; layer 2 head-outer (LHBNC)
    heads_outer = rng.integers(0, 255, (H, B, N, C), dtype=np.uint8)
    views = [View(kv[0]), View(kv[1]), View(heads_outer.transpose(1, 0, 2, 3))]
    values = GroupValues([page_runs(v, B) for v in views], segment_bytes_max=1 << 20)
    memory = mover.alloc_host(4 * values.value_bytes)
    pool = StagingPool(memory, values.value_bytes)
    assert pool.base % 4096 == 0
    saved, loaded = [7, 2, 5], [0, 8, 3]
    before = [kv.copy(), heads_outer.copy()]
    save, load = mover.new_stream("save"), mover.new_stream("load")
    slots = pool.take(3)
    mover.wait_event(save, mover.record(mover.compute_stream()))
    g = values.gather(saved, pool.addresses(slots))
    mover.copy(save, g.dst, g.src, g.sizes)
    done = mover.record(save)
    kept = len(done.keep)
    mover.synchronize(done)
    d2h_order = libcuda.stub_last_order()
    kv[:] = 0
    heads_outer[:] = 0
    s = values.scatter(pool.addresses(slots), loaded)
    mover.copy(load, s.dst, s.src, s.sizes)
    mover.synchronize(mover.record(load))
    exact = all(
        np.array_equal(kv[:, dst], before[0][:, src]) and np.array_equal(heads_outer[:, dst], before[1][:, src])
        for src, dst in zip(saved, loaded)
    )
    others = [b for b in range(B) if b not in loaded]
    out[method] = dict(
        exact=exact, untouched=not kv[:, others].any() and not heads_outer[:, others].any(),
        describe=mover.describe(), priorities=[save.priority, load.priority], kept=kept,
        waited=len(save.waited), ranges=int(g.sizes.size), last_stream=[
            cudart.stub_last_stream() if method == "native-loop" else libcuda.stub_last_stream(), load.cuda_stream],
        d2h_order=d2h_order, h2d_order=libcuda.stub_last_order(),
    )
out["loop_calls"] = cudart.stub_calls()
out["batch_calls"] = libcuda.stub_calls()
out["asked_version"] = libcuda.stub_asked_version()
print(json.dumps(out))
"""


@pytest.mark.process
def test_the_mover_on_stand_in_cuda_libraries_round_trips_byte_exact(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here to build the stand-in CUDA libraries")
    libs = []
    for name, source in (("libcudart.so.99", CUDART_STUB), ("libcuda.so.99", CUDA_STUB)):
        (tmp_path / f"{name}.c").write_text(source)
        subprocess.run([compiler, "-shared", "-fPIC", "-o", tmp_path / name, tmp_path / f"{name}.c"], check=True)
        libs.append(str(tmp_path / name))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER), *libs],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for method in ("native-loop", "native-batch"):
        got = out[method]
        assert got["exact"] and got["untouched"], method
        assert got["describe"]["copy"] == method and got["describe"]["device"] == "stand-in"
        assert got["priorities"] == [0, -5]  # saves at the lowest priority, loads at the highest
        assert got["kept"] == 1 and got["waited"] == 1  # descriptors kept until the event; save waited on compute
        assert got["last_stream"][0] == got["last_stream"][1]  # the copies went on the mover's stream
    assert out["native-loop"]["describe"]["copy_methods"]["vllm"] == "vLLM is not installed"
    # one cudaMemcpyAsync per run (2 layers x 1 run + 1 layer x 2 head runs per block) both ways
    assert out["loop_calls"] == 2 * out["native-loop"]["ranges"]
    assert out["batch_calls"] == 2  # one driver call per batch
    assert out["asked_version"] == 12080
    assert out["native-batch"]["d2h_order"] == 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert out["native-batch"]["h2d_order"] == 3  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY (host sources)
