"""Load a cubin built by build.py and launch it through the CUDA driver API, without Triton.

Driver access: cuda-bindings (``cuda.bindings.driver``, which recent torch brings) when importable,
else ctypes on libcuda (``libcuda.so.1`` / ``nvcuda.dll``); VC_ATTENTION_CUDA_DRIVER=ctypes or
cuda-bindings forces one. Launches go to torch's current stream of the tensors' device.

Parameter ABI: the run-time arguments in the kernel's order, constexprs (and absent pointers)
removed, pointers as 64-bit addresses, ints as 32-bit, then the parameters the building Triton
appended (global scratch and profile scratch pointers since Triton 3.3/3.5): the manifest records
how many, read from the PTX entry of each cubin, so a cubin from another Triton version gets the
parameters it was compiled with. Scratch pointers are NULL unless the kernel asked for scratch.

A cubin is exact-architecture machine code: one built for sm_90a runs on compute capability 9.0 only
(not 10.0, not 12.0; not 8.9). The loader checks the architecture in the manifest and in each cubin's
ELF header before the driver sees it, and refuses a mismatch with WrongArchError. The sm_89 folder
also holds each variant's PTX (.target sm_89): with ptx=True the driver JIT-compiles that for a newer
GPU that has no cubins of its own.

Before anything is launched the manifest's source hash of each kernel is compared with the installed
kernel source (specs.source_hash): cubins built from other source are refused (SourceMismatchError).
"""

import ctypes
import json
import os
import pathlib
import struct
import sys
import threading

from . import specs
from .specs import TORCH_TO_TRITON, variant_key


class PrecompiledError(RuntimeError):
    """The precompiled path cannot run this (missing cubin, driver, assumption not met)."""


class WrongArchError(PrecompiledError):
    """A cubin (or a folder of them) built for another GPU architecture."""


class SourceMismatchError(PrecompiledError):
    """Cubins built from another version of the kernel source than the one installed."""


def cubin_arch(data: bytes) -> int:
    """The SM version a cubin was built for, from its ELF header (90 for sm_90a, 120 for sm_120a)."""
    if len(data) < 52 or data[:4] != b"\x7fELF":
        raise PrecompiledError("not a cubin (no ELF header)")
    if data[4] != 2:
        raise PrecompiledError("not a 64-bit cubin")
    flags = struct.unpack_from("<I", data, 48)[0]
    abi_version = data[8]
    # CUDA ELF ABI v8 (recent ptxas) keeps the SM in bits 8-15 of e_flags; older ones in bits 0-7.
    return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF


def check_arch(expected: int, device_arch: int, what: str) -> None:
    if expected != device_arch:
        raise WrongArchError(
            f"{what} was built for sm_{expected}, this GPU is sm_{device_arch}: a cubin is machine code "
            f"for one architecture (sm_{expected}a runs on compute capability {expected // 10}.{expected % 10} "
            f"only). Use the cubins for sm_{device_arch}, or build them: python -m "
            f"vc_attention.kernels.precompiled.build --arch {device_arch}")


# --- CUDA driver access --------------------------------------------------------------------------

CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_CACHE_PREFER_SHARED = 1
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


class _CtypesDriver:
    name = "ctypes (libcuda)"

    def __init__(self):
        names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
        lib, errors = None, []
        for n in names:
            try:
                lib = ctypes.CDLL(n)
                break
            except OSError as exc:
                errors.append(f"{n}: {exc}")
        if lib is None:
            raise PrecompiledError("the CUDA driver library cannot be loaded (" + "; ".join(errors) + ")")
        self.lib = lib
        for fn in ("cuInit", "cuDriverGetVersion", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet",
                   "cuDevicePrimaryCtxRetain", "cuModuleLoadData", "cuModuleGetFunction", "cuFuncGetAttribute",
                   "cuFuncSetAttribute", "cuFuncSetCacheConfig", "cuDeviceGetAttribute", "cuLaunchKernel",
                   "cuGetErrorName"):
            getattr(lib, fn).restype = ctypes.c_int
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self._check(lib.cuInit(0), "cuInit")

    def _check(self, err, what):
        if err != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(err, ctypes.byref(name))
            raise PrecompiledError(f"{what} failed: {name.value.decode() if name.value else err}")

    def version(self):
        v = ctypes.c_int()
        self._check(self.lib.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        return v.value

    def ensure_context(self, device_index):
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, data: bytes, name: str):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data)), "cuModuleLoadData")
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        return mod.value, fn.value

    def func_attr(self, fn, attr):
        v = ctypes.c_int()
        self._check(self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, ctypes.c_void_p(fn)), "cuFuncGetAttribute")
        return v.value

    def set_func_attr(self, fn, attr, value):
        self._check(self.lib.cuFuncSetAttribute(ctypes.c_void_p(fn), attr, value), "cuFuncSetAttribute")

    def prefer_shared(self, fn):
        self._check(self.lib.cuFuncSetCacheConfig(ctypes.c_void_p(fn), CU_FUNC_CACHE_PREFER_SHARED),
                    "cuFuncSetCacheConfig")

    def device_attr(self, attr, device_index):
        v, dev = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev), "cuDeviceGetAttribute")
        return v.value

    def launch(self, fn, grid, block_x, shared, stream, params_address):
        self._check(self.lib.cuLaunchKernel(ctypes.c_void_p(fn), grid[0], grid[1], grid[2], block_x, 1, 1,
                                            shared, ctypes.c_void_p(stream), ctypes.c_void_p(params_address),
                                            None), "cuLaunchKernel")


def _handle_value(h) -> int:
    """The address a cuda-bindings handle (CUcontext, ...) holds; 0 for NULL."""
    try:
        return int(h)
    except TypeError:
        return ctypes.c_void_p.from_address(h.getPtr()).value or 0


class _BindingsDriver:
    name = "cuda-bindings"

    def __init__(self):
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu  # cuda-python < 12.6 spelling
        self.cu = cu
        self._check(cu.cuInit(0), "cuInit")

    def _check(self, result, what):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            name = self.cu.cuGetErrorName(err)[1]
            raise PrecompiledError(f"{what} failed: {name.decode() if isinstance(name, bytes) else err}")
        return rest[0] if len(rest) == 1 else rest

    def version(self):
        return self._check(self.cu.cuDriverGetVersion(), "cuDriverGetVersion")

    def ensure_context(self, device_index):
        ctx = self._check(self.cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if _handle_value(ctx) == 0:
            dev = self._check(self.cu.cuDeviceGet(device_index), "cuDeviceGet")
            ctx = self._check(self.cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self._check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, data: bytes, name: str):
        mod = self._check(self.cu.cuModuleLoadData(data), "cuModuleLoadData")
        fn = self._check(self.cu.cuModuleGetFunction(mod, name.encode()), "cuModuleGetFunction")
        return mod, fn

    def func_attr(self, fn, attr):
        return self._check(self.cu.cuFuncGetAttribute(self.cu.CUfunction_attribute(attr), fn), "cuFuncGetAttribute")

    def set_func_attr(self, fn, attr, value):
        self._check(self.cu.cuFuncSetAttribute(fn, self.cu.CUfunction_attribute(attr), value), "cuFuncSetAttribute")

    def prefer_shared(self, fn):
        self._check(self.cu.cuFuncSetCacheConfig(fn, self.cu.CUfunc_cache(CU_FUNC_CACHE_PREFER_SHARED)),
                    "cuFuncSetCacheConfig")

    def device_attr(self, attr, device_index):
        dev = self._check(self.cu.cuDeviceGet(device_index), "cuDeviceGet")
        return self._check(self.cu.cuDeviceGetAttribute(self.cu.CUdevice_attribute(attr), dev), "cuDeviceGetAttribute")

    def launch(self, fn, grid, block_x, shared, stream, params_address):
        self._check(self.cu.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block_x, 1, 1, shared,
                                           self.cu.CUstream(stream), params_address, 0), "cuLaunchKernel")


_driver_lock = threading.Lock()
_driver_cache = {}


def get_driver(which=None):
    """The driver wrapper (cached): cuda-bindings if importable, else ctypes; raises PrecompiledError."""
    which = which or os.environ.get("VC_ATTENTION_CUDA_DRIVER", "auto")
    with _driver_lock:
        if which not in _driver_cache:
            try:
                if which == "ctypes":
                    _driver_cache[which] = _CtypesDriver()
                elif which == "cuda-bindings":
                    _driver_cache[which] = _BindingsDriver()
                else:
                    try:
                        _driver_cache[which] = _BindingsDriver()
                    except Exception:  # not installed, or broken: the driver library itself
                        _driver_cache[which] = _CtypesDriver()
            except PrecompiledError as exc:
                _driver_cache[which] = exc
            except Exception as exc:  # a broken cuda-bindings install
                _driver_cache[which] = PrecompiledError(f"CUDA driver access failed: {type(exc).__name__}: {exc}")
        got = _driver_cache[which]
    if isinstance(got, Exception):
        raise got
    return got


# --- manifests and launching -------------------------------------------------------------------

def read_manifest(directory) -> dict:
    path = pathlib.Path(directory) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PrecompiledError(f"no manifest.json in {directory}") from None
    if manifest.get("format") != specs.MANIFEST_FORMAT:
        raise PrecompiledError(
            f"{path}: manifest format {manifest.get('format')!r}, this loader reads format "
            f"{specs.MANIFEST_FORMAT}: rebuild the cubins (python -m vc_attention.kernels.precompiled.build "
            f"--arch {manifest.get('arch', 'N')} --out {pathlib.Path(directory).parent}) or reinstall the wheel")
    return manifest


def check_sources(manifest, directory, root=None) -> None:
    """Refuse cubins whose kernel source (the hash the build recorded) is not the installed one."""
    root = specs.PACKAGE_ROOT if root is None else root
    for kernel, built in sorted(manifest.get("sources", {}).items()):
        try:
            now = specs.source_hash(kernel, root)
        except (OSError, KeyError) as exc:
            now = f"none ({type(exc).__name__}: {exc})"
        if now != built["sha256"]:
            raise SourceMismatchError(
                f"the precompiled {kernel} in {directory} was built from kernel source sha256 "
                f"{built['sha256']}, the installed source ({', '.join(built['files'])}) hashes to {now}: "
                f"cubins of other source are not launched. Rebuild them (python -m "
                f"vc_attention.kernels.precompiled.build --arch {manifest['arch']} --out "
                f"{pathlib.Path(directory).parent}) or reinstall the vc-attention wheel, whose cubins "
                f"match its source")
    missing = {e["kernel"] for e in manifest["kernels"]} - set(manifest.get("sources", {}))
    if missing:
        raise SourceMismatchError(f"{directory}/manifest.json has no source hash for {sorted(missing)}: rebuild")


def ptx_arch(target) -> int:
    """70 for "sm_70", 89 for "sm_89"; ValueError for an arch-specific target ("sm_90a": no JIT to others)."""
    if not target or not target.startswith("sm_") or not target[3:].isdigit():
        raise ValueError(f"PTX target {target!r} is not a portable sm_NN target")
    return int(target[3:])


def _torch_type(t) -> str:
    name = str(t.dtype).replace("torch.", "")
    return TORCH_TO_TRITON.get(name, name)


class CubinKernels:
    """The cubins of one folder (one manifest), for one device. Callable as a launcher for
    kernels/pipeline.py: launcher(kernel, grid, args, constexprs, num_warps, num_stages)."""

    def __init__(self, directory, device_index: int, device_arch: int, driver=None, ptx: bool = False):
        self.directory = pathlib.Path(directory)
        self.manifest = read_manifest(self.directory)
        check_sources(self.manifest, self.directory)
        self.ptx = ptx
        if ptx:  # the folder's PTX, JIT-compiled by the driver for this (newer) GPU
            built = int(self.manifest["arch"])
            if built > device_arch:
                raise WrongArchError(f"the PTX in {self.directory} targets sm_{built}: it runs on sm_{built} "
                                     f"and newer GPUs, this GPU is sm_{device_arch}")
        else:
            check_arch(int(self.manifest["arch"]), device_arch, f"the cubin folder {self.directory}")
        self.device_index = device_index
        self.device_arch = device_arch
        self.driver = driver
        self.by_key = {e["key"]: e for e in self.manifest["kernels"]}
        self._functions = {}
        self._lock = threading.Lock()

    @property
    def attention_kernel(self):
        """The attention kernel these cubins carry (specs.attention_kernel of the folder's arch)."""
        return next((e["kernel"] for e in self.manifest["kernels"] if e["tags"].get("role") == "attention"), None)

    def read_cubin(self, entry) -> bytes:
        data = (self.directory / entry["file"]).read_bytes()
        check_arch(cubin_arch(data), self.device_arch, f"cubin {entry['file']}")
        return data

    def read_ptx(self, entry) -> bytes:
        """The entry's PTX, NUL-terminated for cuModuleLoadData, after its target is checked."""
        if "ptx" not in entry:
            raise PrecompiledError(f"{self.directory}: no PTX for {entry['file']}")
        try:
            target = ptx_arch(entry.get("ptx_target"))
        except ValueError as exc:
            raise WrongArchError(f"{entry['ptx']}: {exc}") from None
        if target > self.device_arch:
            raise WrongArchError(f"{entry['ptx']} targets sm_{target}, this GPU is sm_{self.device_arch}")
        return (self.directory / entry["ptx"]).read_bytes() + b"\0"

    def read_code(self, entry) -> bytes:
        return self.read_ptx(entry) if self.ptx else self.read_cubin(entry)

    def function(self, entry):
        """Load the cubin of one entry into the current context (once) -> (CUfunction, shared bytes)."""
        with self._lock:
            got = self._functions.get(entry["key"])
            if got is None:
                driver = self.driver or get_driver()
                data = self.read_code(entry)
                driver.ensure_context(self.device_index)
                try:
                    module, fn = driver.load(data, entry["name"])
                except Exception as exc:  # PrecompiledError, or a cuda-bindings error
                    what = f"the PTX {entry['ptx']} (JIT for sm_{self.device_arch})" if self.ptx else entry["file"]
                    raise PrecompiledError(
                        f"{exc} for {what} (built by Triton {self.manifest['triton_version']}, "
                        f"PTX ISA {entry.get('ptx_version')}; CUDA driver {driver.version()})") from None
                shared = int(entry["shared"])
                if shared > 49152:
                    optin = driver.device_attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                               self.device_index)
                    if shared > optin:
                        raise PrecompiledError(f"{entry['file']} needs {shared} bytes of shared memory, this GPU "
                                               f"allows {optin}")
                    driver.prefer_shared(fn)
                    static = driver.func_attr(fn, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                    driver.set_func_attr(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static)
                got = (module, fn, shared)
                self._functions[entry["key"]] = got
        return got[1], got[2]

    def find(self, kernel, args, constexprs, num_warps, num_stages):
        pointers = {}
        for name, value in args.items():
            if value is None:
                pointers[name] = None
            elif hasattr(value, "data_ptr"):
                pointers[name] = _torch_type(value)
        key = variant_key(kernel, pointers, constexprs, num_warps, num_stages)
        entry = self.by_key.get(key)
        if entry is None:
            raise PrecompiledError(f"no precompiled {kernel} for this call in {self.directory} "
                                   f"(pointers {pointers}, constexprs {constexprs})")
        return entry

    def __call__(self, kernel, grid, args, constexprs, num_warps, num_stages=None):
        import torch

        entry = self.find(kernel, args, constexprs, num_warps, num_stages)
        assume = entry["assume"]
        for name in assume["one"]:
            if args[name] != 1:
                raise PrecompiledError(f"{kernel}: the cubin assumes {name} == 1, got {args[name]}")
        for name in assume["div16"]:
            if args[name] % 16:
                raise PrecompiledError(f"{kernel}: the cubin assumes {name} % 16 == 0, got {args[name]}")
        values = []
        for name, ty in entry["params"]:
            value = args[name]
            if ty.startswith("*"):
                if value.device.type != "cuda" or value.device.index != self.device_index:
                    raise PrecompiledError(f"{kernel}: {name} is on {value.device}, the cubins on cuda:{self.device_index}")
                ptr = value.data_ptr()
                if ptr % 16:
                    raise PrecompiledError(f"{kernel}: the cubin assumes {name} is 16-byte aligned")
                values.append(ctypes.c_uint64(ptr))
            elif ty == "i32":
                if not -2 ** 31 <= int(value) < 2 ** 31:
                    raise PrecompiledError(f"{kernel}: {name} = {value} does not fit the cubin's int32 parameter")
                values.append(ctypes.c_int32(int(value)))
            elif ty == "fp32":
                values.append(ctypes.c_float(float(value)))
            else:
                raise PrecompiledError(f"{kernel}: parameter type {ty} is not supported by the loader")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        n_programs = grid[0] * grid[1] * grid[2] * int(entry.get("num_ctas", 1))
        keep = []
        scratch = [(entry["global_scratch_size"], entry["global_scratch_align"]),
                   (entry["profile_scratch_size"], entry["profile_scratch_align"])]
        for i in range(int(entry["extra_params"])):
            size, align = scratch[i] if i < len(scratch) else (0, 1)
            if size > 0:
                buf = torch.empty(n_programs * size + align, dtype=torch.uint8, device=f"cuda:{self.device_index}")
                keep.append(buf)
                ptr = buf.data_ptr()
                values.append(ctypes.c_uint64((ptr + align - 1) // align * align))
            else:
                values.append(ctypes.c_uint64(0))
        if len(values) != len(entry["ptx_params"]):
            raise PrecompiledError(f"{kernel}: {len(values)} parameters packed, the cubin takes "
                                   f"{len(entry['ptx_params'])}")
        if entry.get("num_ctas", 1) != 1 or entry.get("launch_cooperative_grid") or entry.get("launch_pdl"):
            raise PrecompiledError(f"{kernel}: clusters, cooperative or PDL launches are not supported by the loader")
        if grid[0] * grid[1] * grid[2] == 0:
            return
        with torch.cuda.device(self.device_index):
            fn, shared = self.function(entry)
            stream = torch.cuda.current_stream(self.device_index).cuda_stream
            params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            (self.driver or get_driver()).launch(fn, grid, 32 * int(entry["num_warps"]), shared, stream,
                                                 ctypes.addressof(params))
        del keep  # the caching allocator reuses the scratch only after this stream's work
