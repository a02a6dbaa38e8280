# A torch tensor's layout in one C call: DLPack's C exchange API (dlpack.h, DLPack 1.2+,
# ``DLPackExchangeAPI.dltensor_from_py_object_no_sync``: a non-owning ``DLTensor`` filled
# in place, no allocation), which torch exposes on its tensor type as the capsule
# ``torch.Tensor.__dlpack_c_exchange_api__`` (named ``"dlpack_exchange_api"``). Reading the
# same facts through torch's Python attributes (dtype, device, stride, shape, data_ptr)
# costs one call each — included by _native.pyx (shares its cimports)

from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.exc cimport PyErr_Clear
from libc.stdint cimport uint16_t, uint32_t

cdef extern from *:
    """
    /* The DLPack structs this module reads, as dlpack.h lays them out (major version 1). */
    typedef struct { uint32_t major; uint32_t minor; } attnplug_dl_version;
    typedef struct { int32_t device_type; int32_t device_id; } attnplug_dl_device;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } attnplug_dl_dtype;
    typedef struct {
        void *data; attnplug_dl_device device; int32_t ndim; attnplug_dl_dtype dtype;
        int64_t *shape; int64_t *strides; uint64_t byte_offset;
    } attnplug_dl_tensor;
    typedef struct attnplug_dl_api_header {
        attnplug_dl_version version; struct attnplug_dl_api_header *prev_api;
    } attnplug_dl_api_header;
    typedef int (*attnplug_dl_tensor_from_py)(void *py_object, attnplug_dl_tensor *out);
    typedef struct {
        attnplug_dl_api_header header;
        void *managed_tensor_allocator;
        void *managed_tensor_from_py_object_no_sync;
        void *managed_tensor_to_py_object_no_sync;
        attnplug_dl_tensor_from_py dltensor_from_py_object_no_sync;
        void *current_work_stream;
    } attnplug_dl_api;
    """
    ctypedef struct attnplug_dl_version:
        uint32_t major
    ctypedef struct attnplug_dl_device:
        int32_t device_type
    ctypedef struct attnplug_dl_dtype:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct attnplug_dl_tensor:
        void* data
        attnplug_dl_device device
        int32_t ndim
        attnplug_dl_dtype dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset
    ctypedef struct attnplug_dl_api_header:
        attnplug_dl_version version
    ctypedef int (*attnplug_dl_tensor_from_py)(void* py_object, attnplug_dl_tensor* out) noexcept
    ctypedef struct attnplug_dl_api:
        attnplug_dl_api_header header
        attnplug_dl_tensor_from_py dltensor_from_py_object_no_sync

cdef enum:
    _DL_CPU = 1  # DLDeviceType kDLCPU
    _DL_INT = 0  # DLDataTypeCode kDLInt

cdef attnplug_dl_tensor_from_py _dl_view = NULL
cdef object _dl_type = None


def bind_tensor_type(tensor_type):
    """Read ``tensor_type.__dlpack_c_exchange_api__`` (``torch.Tensor``'s) for
    :func:`host_int64_vector`. Returns whether it is usable: a ``"dlpack_exchange_api"``
    capsule of DLPack major version 1 with ``dltensor_from_py_object_no_sync``. Otherwise
    :func:`host_int64_vector` answers -1 for every object."""
    global _dl_view, _dl_type
    cdef attnplug_dl_api* api
    cap = getattr(tensor_type, "__dlpack_c_exchange_api__", None)
    _dl_view, _dl_type = NULL, None
    if cap is None or not PyCapsule_IsValid(cap, "dlpack_exchange_api"):
        return False
    api = <attnplug_dl_api*>PyCapsule_GetPointer(cap, "dlpack_exchange_api")
    if api.header.version.major != 1 or api.dltensor_from_py_object_no_sync == NULL:
        return False
    _dl_view, _dl_type = api.dltensor_from_py_object_no_sync, tensor_type
    return True


def host_int64_vector(object t, Py_ssize_t n):
    """The host address of ``t``'s first element when ``t`` is exactly the bound tensor
    type (no subclass), on the CPU, ``int64``, 1-D with ``n >= 0`` elements at unit stride
    (any stride when ``n <= 1``) and, unless ``n = 0``, a data pointer (torch's zero tensors
    have none): ``n`` int64 values back to back that a kernel may read in place while ``t``
    lives. -1 for anything else, including every object the exchange API refuses (its error
    is cleared: the caller's general check words it). Not seen through DLPack: torch's
    negative bit (``torch._neg_view``, a private function, is the only maker of an integer
    one); such a tensor is read as stored."""
    cdef attnplug_dl_tensor d
    if _dl_view == NULL or type(t) is not _dl_type or n < 0:
        return -1
    if _dl_view(<void*>t, &d) != 0:
        PyErr_Clear()
        return -1
    if (d.device.device_type != _DL_CPU or d.dtype.code != _DL_INT or d.dtype.bits != 64 or d.dtype.lanes != 1
            or d.ndim != 1 or d.shape[0] != n or (n > 1 and d.strides[0] != 1) or (n and d.data == NULL)):
        return -1
    return <size_t>(<char*>d.data + d.byte_offset)
