/* flash_gen's per-call launch in C: copy a kernel's parameter template, write this call's addresses into the
 * copy, cuLaunchKernel. From Python the same steps cost ~13 µs per launch through ctypes (a Structure copy,
 * field assignments, a foreign call converting 11 arguments); here they cost well under one.
 *
 * Built with the package (setup.py, optional): without it flash_gen.runtime.driver does the same in Python.
 * Needs no CUDA headers: libcuda is opened on the first launch, so importing this works on a machine without
 * a GPU (the tests check pack() there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

/* cuLaunchKernel's kernelParams copy the struct at launch, so a stack buffer suffices. 4 KiB is the classic
 * kernel-parameter limit; flash_gen's largest struct (the Hopper forward's, four TMA maps) is under 1 KiB. */
#define MAX_PARAM_BYTES 4096

typedef int (*LaunchFn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void *stream, void **params, void **extra);

static LaunchFn cu_launch_kernel = NULL;

static int load_driver(void) {
    if (cu_launch_kernel) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        PyErr_Format(PyExc_RuntimeError, "flash_gen: cannot open libcuda.so.1: %s", dlerror());
        return -1;
    }
    cu_launch_kernel = (LaunchFn)dlsym(lib, "cuLaunchKernel");
    if (!cu_launch_kernel) {
        PyErr_SetString(PyExc_RuntimeError, "flash_gen: libcuda.so.1 has no cuLaunchKernel");
        return -1;
    }
    return 0;
}

/* Copy `params` (any buffer) into `dest` and apply `patches`, a tuple (offset, value, offset, value, ...) of
 * 8-byte values written at patch_base + offset. Returns the size, or -1 with a Python error set. */
static Py_ssize_t pack_into(unsigned char *dest, PyObject *params, PyObject *patches, Py_ssize_t patch_base) {
    Py_buffer view;
    if (PyObject_GetBuffer(params, &view, PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t size = view.len;
    if (size > MAX_PARAM_BYTES) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "flash_gen: kernel parameters of %zd bytes exceed %d", size, MAX_PARAM_BYTES);
        return -1;
    }
    memcpy(dest, view.buf, (size_t)size);
    PyBuffer_Release(&view);
    if (!PyTuple_Check(patches) || PyTuple_GET_SIZE(patches) % 2) {
        PyErr_SetString(PyExc_TypeError, "flash_gen: patches must be a tuple (offset, value, ...)");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(patches); i += 2) {
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(patches, i));
        uint64_t value = (uint64_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(patches, i + 1));
        if (PyErr_Occurred()) return -1;
        offset += patch_base;
        if (offset < 0 || offset + 8 > size) {
            PyErr_Format(PyExc_ValueError, "flash_gen: patch at byte %zd outside the %zd-byte parameters", offset,
                         size);
            return -1;
        }
        memcpy(dest + offset, &value, 8);
    }
    return size;
}

/* pack(params, patches, patch_base) -> bytes: what launch() passes to the kernel (for tests). */
static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pack(params, patches, patch_base)");
        return NULL;
    }
    _Alignas(64) unsigned char buf[MAX_PARAM_BYTES];
    Py_ssize_t base = PyLong_AsSsize_t(args[2]);
    if (base == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t size = pack_into(buf, args[0], args[1], base);
    return size < 0 ? NULL : PyBytes_FromStringAndSize((const char *)buf, size);
}

/* launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, patches, patch_base) -> CUresult as an int.
 * function and stream are the CUfunction and CUstream handles as ints. */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError,
                        "launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, patches, patch_base)");
        return NULL;
    }
    if (load_driver() < 0) return NULL;
    void *function = PyLong_AsVoidPtr(args[0]);
    unsigned dims[7];
    for (int i = 0; i < 7; ++i) dims[i] = (unsigned)PyLong_AsUnsignedLong(args[1 + i]);
    void *stream = PyLong_AsVoidPtr(args[8]);
    Py_ssize_t base = PyLong_AsSsize_t(args[11]);
    if (PyErr_Occurred()) return NULL;
    _Alignas(64) unsigned char buf[MAX_PARAM_BYTES];  /* TMA maps in the struct need 64-byte alignment */
    if (pack_into(buf, args[9], args[10], base) < 0) return NULL;
    void *kernel_params[1] = {buf};
    int err;
    /* A launch blocks while the stream's queue is full: let other Python threads run meanwhile, as ctypes did. */
    Py_BEGIN_ALLOW_THREADS
    err = cu_launch_kernel(function, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], stream,
                           kernel_params, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "Launch a kernel with a patched parameter copy."},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, "The parameter bytes launch() would pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__launch(void) { return PyModule_Create(&module); }
