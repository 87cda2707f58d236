// Per-sample fields read from Python objects, and the incremental trie's binding.
//
// A row's samples arrive one Python object per sample and field: lists of ints or floats, numpy
// arrays (TRL's rollout fields) or tensors. Read here in one pass, a value costs nanoseconds, where
// a torch.tensor() per sample costs microseconds of fixed overhead before the first value. Every
// value is checked as it is read (integer ids >= 0, 0/1 masks, real numbers) and a bad one raises a
// ValueError or TypeError naming its field (`samples[3]`, `sample['completion_mask']`).
//
// The values written are the ones torch's own conversions give (a float64 log-prob rounds to the
// nearest float32, as Tensor.to(torch.float32) does), so a pack is the same for any input form.
#include "packing_py.h"

#include <c10/util/Half.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "alloc.h"
#include "packing.h"

namespace py = pybind11;

namespace rlvr {
namespace {

enum class Kind { Ids, Mask, Values };

// A field's name for errors, formatted only when one is raised.
struct Name {
  const std::string& base;
  int64_t index;  // -1: the base alone, else base[index]
  std::string str() const { return index < 0 ? base : base + "[" + std::to_string(index) + "]"; }
};

[[noreturn]] void type_error(const Name& n, const std::string& what) { throw py::type_error(n.str() + ": " + what); }
[[noreturn]] void value_error(const Name& n, const std::string& what) { throw py::value_error(n.str() + ": " + what); }

std::string type_name(PyObject* o) { return Py_TYPE(o)->tp_name; }

// dtype as Python prints it, without torch's "torch." prefix (error path only).
std::string dtype_name(py::handle x) {
  std::string s = py::str(x.attr("dtype"));
  return s.rfind("torch.", 0) == 0 ? s.substr(6) : s;
}

std::string shape_of(py::handle x) {
  if (PyList_Check(x.ptr()) || PyTuple_Check(x.ptr())) return "(" + std::to_string(py::len(x)) + ",)";
  return py::str(py::tuple(x.attr("shape")));
}

PyTypeObject* ndarray_type() {
  static PyObject* t = py::object(py::module_::import("numpy").attr("ndarray")).release().ptr();
  return reinterpret_cast<PyTypeObject*>(t);
}

// A buffer's element type: kind 'i' signed, 'u' unsigned, 'b' bool, 'f' float, 'c' complex, 0 one
// not read here (objects, strings, long double, the other byte order).
struct Fmt {
  char kind = 0;
  Py_ssize_t size = 0;
};

Fmt parse_format(const char* f, Py_ssize_t itemsize) {
  constexpr bool little = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
  if (f == nullptr) return {'u', 1};
  if (*f == '@' || *f == '=' || *f == '|') {
    ++f;
  } else if (*f == '<' || *f == '>' || *f == '!') {
    if ((*f == '<') != little) return {};
    ++f;
  }
  if (f[0] == 'Z') return {'c', itemsize};
  if (f[0] == 0 || f[1] != 0) return {};
  const Py_ssize_t s = itemsize;
  const bool int_size = s == 1 || s == 2 || s == 4 || s == 8;
  switch (f[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
      return int_size ? Fmt{'i', s} : Fmt{};
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
      return int_size ? Fmt{'u', s} : Fmt{};
    case '?':
      return s == 1 ? Fmt{'b', 1} : Fmt{};
    case 'e': case 'f': case 'd':
      return s == 2 || s == 4 || s == 8 ? Fmt{'f', s} : Fmt{};
    default:
      return {};
  }
}

template <class T, class Out>
inline Out load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return static_cast<Out>(v);
}

// One buffer element as Out, by the conversion torch applies to the same dtype.
template <class Out>
inline Out element(const char* p, Fmt f) {
  switch (f.kind) {
    case 'i':
      switch (f.size) {
        case 1: return load<int8_t, Out>(p);
        case 2: return load<int16_t, Out>(p);
        case 4: return load<int32_t, Out>(p);
        default: return load<int64_t, Out>(p);
      }
    case 'u':
      switch (f.size) {
        case 1: return load<uint8_t, Out>(p);
        case 2: return load<uint16_t, Out>(p);
        case 4: return load<uint32_t, Out>(p);
        default: return load<uint64_t, Out>(p);
      }
    case 'b':
      return static_cast<Out>(*p != 0);
    default:
      switch (f.size) {
        case 2: {
          uint16_t bits;
          std::memcpy(&bits, p, 2);
          return static_cast<Out>(static_cast<float>(c10::Half(bits, c10::Half::from_bits())));
        }
        case 4: return load<float, Out>(p);
        default: return load<double, Out>(p);
      }
  }
}

// One sample's field, opened (type, dtype and shape checked) but not yet read.
struct Part {
  enum Source { kTensor, kBuffer, kList } src = kList;
  PyObject* obj = nullptr;           // kList: the list or tuple
  at::Tensor t;                      // kTensor: CPU, contiguous, int64 (ids), float64 (mask), float32 (values)
  std::shared_ptr<Py_buffer> view;   // kBuffer: a 1-D numpy array's buffer
  Fmt fmt;
  py::object keep;                   // an array made here (np.asarray, a flattened copy), kept alive
  int64_t n = 0;
  int64_t ndim = 1;                  // of the object given (a mask or values part is read flattened)
  bool floating = false;             // a floating dtype, or a list holding a float (or empty)
};

std::shared_ptr<Py_buffer> get_buffer(PyObject* o) {
  auto* v = new Py_buffer;
  if (PyObject_GetBuffer(o, v, PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
    delete v;
    PyErr_Clear();
    return nullptr;
  }
  return std::shared_ptr<Py_buffer>(v, [](Py_buffer* b) {
    PyBuffer_Release(b);
    delete b;
  });
}

const char* what_of(Kind kind) { return kind == Kind::Ids ? "integer token ids" : "numbers"; }

Part open_part(py::handle x, const Name& name, Kind kind) {
  PyObject* o = x.ptr();
  Part p;
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.is_meta()) value_error(name, "expected a tensor with data, got a meta tensor (it holds no values to read)");
    const auto st = t.scalar_type();
    const bool is_float = at::isFloatingType(st), is_complex = at::isComplexType(st);
    p.src = Part::kTensor;
    p.ndim = t.dim();
    if (kind == Kind::Ids) {
      if (is_float || is_complex || st == at::kBool)
        type_error(name, "token ids must be integers, got dtype " + dtype_name(x));
      if (t.dim() != 1) value_error(name, "expected a 1-D sequence of token ids, got shape " + shape_of(x));
      p.t = t.to(at::Device(at::kCPU), at::kLong).contiguous();
    } else {
      if (is_complex) {
        if (kind == Kind::Mask) type_error(name, "expected a bool, integer or float mask, got dtype " + dtype_name(x));
        type_error(name, "expected real numbers, got dtype " + dtype_name(x));
      }
      p.t = t.reshape(-1).to(at::Device(at::kCPU), kind == Kind::Mask ? at::kDouble : at::kFloat).contiguous();
      p.floating = is_float;
    }
    p.n = p.t.numel();
    return p;
  }
  if (PyObject_TypeCheck(o, ndarray_type())) {
    auto view = get_buffer(o);
    const Fmt fmt = view ? parse_format(view->format, view->itemsize) : Fmt{};
    if (fmt.kind == 0)
      type_error(name, std::string("expected ") + what_of(kind) + ", got a numpy array of dtype " + dtype_name(x));
    if (kind == Kind::Ids) {
      if (fmt.kind == 'b' || fmt.kind == 'f' || fmt.kind == 'c')
        type_error(name, "token ids must be integers, got dtype " + dtype_name(x));
      if (view->ndim != 1) value_error(name, "expected a 1-D sequence of token ids, got shape " + shape_of(x));
    } else if (fmt.kind == 'c') {
      if (kind == Kind::Mask) type_error(name, "expected a bool, integer or float mask, got dtype " + dtype_name(x));
      type_error(name, "expected real numbers, got dtype " + dtype_name(x));
    }
    if (view->ndim != 1) {  // read in C order, as torch.from_numpy(array).reshape(-1)
      view.reset();
      py::object flat = x.attr("reshape")(-1);
      Part q = open_part(flat, name, kind);
      q.keep = flat;
      q.ndim = py::len(x.attr("shape"));
      return q;
    }
    p.src = Part::kBuffer;
    p.view = view;
    p.fmt = fmt;
    p.n = view->shape[0];
    p.floating = fmt.kind == 'f';
    return p;
  }
  if (PyList_Check(o) || PyTuple_Check(o)) {
    p.src = Part::kList;
    p.obj = o;
    p.n = PySequence_Fast_GET_SIZE(o);
    p.floating = p.n == 0;  // numpy's dtype for an empty list
    return p;
  }
  if (kind == Kind::Ids)
    type_error(name, "expected a list, 1-D tensor or numpy array of token ids, got " + type_name(o));
  // Any other sequence of numbers (a range, a scalar): as numpy reads it.
  py::object arr;
  try {
    arr = py::module_::import("numpy").attr("asarray")(x);
  } catch (py::error_already_set&) {
    type_error(name, "expected a sequence of numbers, got " + type_name(o));
  }
  const std::string k = py::str(arr.attr("dtype").attr("kind"));
  if (k.size() != 1 || std::string("biuf").find(k[0]) == std::string::npos)
    type_error(name, "expected a sequence of numbers, got " + dtype_name(arr) + " values");
  Part q = open_part(arr, name, kind);
  q.keep = arr;
  return q;
}

// A list item as an int64 token id.
int64_t list_id(PyObject* e, const Name& name) {
  if (PyBool_Check(e)) type_error(name, "token ids must be integers, got dtype bool");
  if (PyFloat_Check(e)) type_error(name, "token ids must be integers, got dtype float");
  py::object idx;
  if (!PyLong_Check(e)) {
    if (!PyIndex_Check(e)) type_error(name, "expected a sequence of integer token ids (int64)");
    idx = py::reinterpret_steal<py::object>(PyNumber_Index(e));
    if (!idx) {
      PyErr_Clear();
      type_error(name, "expected a sequence of integer token ids (int64)");
    }
    e = idx.ptr();
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(e, &overflow);
  if (overflow) type_error(name, "expected a sequence of integer token ids (int64)");
  return v;
}

// A list item as a number (double), marking `floating` for a float.
double list_number(PyObject* e, const Name& name, bool& floating) {
  if (PyFloat_Check(e)) {
    floating = true;
    return PyFloat_AS_DOUBLE(e);
  }
  if (PyLong_Check(e)) {
    const double v = PyLong_AsDouble(e);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return std::numeric_limits<double>::infinity();  // beyond any double: not 0/1, not a log-prob
    }
    return v;
  }
  if (PyComplex_Check(e) || PyList_Check(e) || PyTuple_Check(e) || PyUnicode_Check(e) || PyBytes_Check(e))
    type_error(name, "expected a sequence of numbers, got a " + type_name(e) + " in it");
  const double v = PyFloat_AsDouble(e);  // numpy scalars, 0-d tensors
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    type_error(name, "expected a sequence of numbers, got a " + type_name(e) + " in it");
  }
  floating = floating || !PyIndex_Check(e);
  return v;
}

void check_size(const Part& p, const Name& name) {
  if (PySequence_Fast_GET_SIZE(p.obj) != p.n) value_error(name, "the list changed size while it was read");
}

void read_ids(const Part& p, const Name& name, int64_t* dst) {
  if (p.n == 0) return;  // (an empty part's data pointer may be null: nothing to copy)
  if (p.src == Part::kTensor) {
    std::memcpy(dst, p.t.data_ptr<int64_t>(), p.n * sizeof(int64_t));
  } else if (p.src == Part::kBuffer) {
    const char* base = static_cast<const char*>(p.view->buf);
    const Py_ssize_t stride = p.view->strides[0];
    if (p.fmt.kind == 'i' && p.fmt.size == 8 && stride == 8) {
      std::memcpy(dst, base, p.n * sizeof(int64_t));
    } else if (p.fmt.kind == 'u' && p.fmt.size == 8) {
      for (int64_t i = 0; i < p.n; ++i) {
        const uint64_t v = load<uint64_t, uint64_t>(base + i * stride);
        if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          value_error(name, "token ids must fit in int64, got " + std::to_string(v));
        dst[i] = static_cast<int64_t>(v);
      }
    } else {
      for (int64_t i = 0; i < p.n; ++i) dst[i] = element<int64_t>(base + i * stride, p.fmt);
    }
  } else {
    PyObject** items = PySequence_Fast_ITEMS(p.obj);
    for (int64_t i = 0; i < p.n; ++i) {
      PyObject* e = items[i];
      if (PyLong_CheckExact(e)) {
        int overflow = 0;
        dst[i] = PyLong_AsLongLongAndOverflow(e, &overflow);
        if (overflow) type_error(name, "expected a sequence of integer token ids (int64)");
      } else {
        dst[i] = list_id(e, name);
        check_size(p, name);
        items = PySequence_Fast_ITEMS(p.obj);
      }
    }
  }
  for (int64_t i = 0; i < p.n; ++i)
    if (dst[i] < 0) value_error(name, "token ids must be non-negative, got " + std::to_string(dst[i]));
}

void read_mask(const Part& p, const Name& name, uint8_t* dst) {
  auto put = [&](int64_t i, double v) {
    if (v != 0.0 && v != 1.0) value_error(name, "expected 0/1 values");
    dst[i] = v != 0.0;
  };
  if (p.src == Part::kTensor) {
    const double* v = p.t.data_ptr<double>();
    for (int64_t i = 0; i < p.n; ++i) put(i, v[i]);
  } else if (p.src == Part::kBuffer) {
    const char* base = static_cast<const char*>(p.view->buf);
    const Py_ssize_t stride = p.view->strides[0];
    for (int64_t i = 0; i < p.n; ++i) put(i, element<double>(base + i * stride, p.fmt));
  } else {
    bool floating = false;
    for (int64_t i = 0; i < p.n; ++i) {
      PyObject* e = PySequence_Fast_ITEMS(p.obj)[i];
      put(i, e == Py_True ? 1.0 : e == Py_False ? 0.0 : list_number(e, name, floating));
      check_size(p, name);
    }
  }
}

// Returns whether the part holds floating-point values.
bool read_values(const Part& p, const Name& name, float* dst) {
  if (p.n == 0) return p.floating;  // (an empty part's data pointer may be null)
  if (p.src == Part::kTensor) {
    std::memcpy(dst, p.t.data_ptr<float>(), p.n * sizeof(float));
    return p.floating;
  }
  if (p.src == Part::kBuffer) {
    const char* base = static_cast<const char*>(p.view->buf);
    const Py_ssize_t stride = p.view->strides[0];
    for (int64_t i = 0; i < p.n; ++i) dst[i] = element<float>(base + i * stride, p.fmt);
    return p.floating;
  }
  bool floating = p.floating;
  for (int64_t i = 0; i < p.n; ++i) {
    PyObject* e = PySequence_Fast_ITEMS(p.obj)[i];
    dst[i] = static_cast<float>(list_number(e, name, floating));
    check_size(p, name);
  }
  return floating;
}

// Element i of an opened values part, as float32.
float value_at(const Part& p, int64_t i, const Name& name) {
  if (p.src == Part::kTensor) return p.t.data_ptr<float>()[i];
  if (p.src == Part::kBuffer)
    return element<float>(static_cast<const char*>(p.view->buf) + i * p.view->strides[0], p.fmt);
  bool floating = false;
  return static_cast<float>(list_number(PySequence_Fast_GET_ITEM(p.obj, i), name, floating));
}

// The items of a list or tuple (or any sequence, as a list), kept alive by the returned object.
py::object fast_sequence(py::handle seq, const Name& name, const std::string& what) {
  PyObject* o = seq.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) return py::reinterpret_borrow<py::object>(seq);
  if (PyUnicode_Check(o) || PyBytes_Check(o) || THPVariable_Check(o) || !PySequence_Check(o))
    type_error(name, "expected " + what + ", got " + type_name(o));
  PyObject* f = PySequence_Fast(o, "");
  if (f == nullptr) {
    PyErr_Clear();
    type_error(name, "expected " + what + ", got " + type_name(o));
  }
  return py::reinterpret_steal<py::object>(f);
}

// (tokens [T] int64, cu_tokens [B+1] int64) of B per-sample token-id sequences.
py::tuple read_token_ids(py::handle samples, const std::string& name) {
  const Name whole{name, -1};
  py::object seq = fast_sequence(samples, whole, "a list of token-id sequences");
  const int64_t B = PySequence_Fast_GET_SIZE(seq.ptr());
  std::vector<Part> parts;
  parts.reserve(B);
  torch::Tensor cu = torch::empty({B + 1}, torch::kInt64);
  int64_t* c = cu.data_ptr<int64_t>();
  c[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    parts.push_back(open_part(PySequence_Fast_GET_ITEM(seq.ptr(), b), Name{name, b}, Kind::Ids));
    c[b + 1] = c[b] + parts.back().n;
  }
  torch::Tensor tokens = empty_output({c[B]}, torch::kInt64);
  int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) read_ids(parts[b], Name{name, b}, t + c[b]);
  return py::make_tuple(tokens, cu);
}

// A per-token field given per sample, flattened to [T]: a 0/1 mask as bool (kind "mask") or
// numbers as float32 (kind "values"; with require_float, at least one part must be floating-point,
// as the dtype torch.cat would give the parts).
torch::Tensor read_per_token(py::handle values, const std::string& name, const torch::Tensor& cu_tokens,
                             const std::string& kind, bool require_float) {
  const Name whole{name, -1};
  if (kind != "mask" && kind != "values") value_error(Name{std::string("kind"), -1}, "expected 'mask' or 'values'");
  if (cu_tokens.dim() != 1 || cu_tokens.numel() < 1 || cu_tokens.scalar_type() != torch::kInt64 ||
      !cu_tokens.is_contiguous() || !cu_tokens.device().is_cpu())
    value_error(Name{std::string("cu_tokens"), -1}, "expected a contiguous 1-D int64 CPU tensor of B + 1 offsets");
  const int64_t B = cu_tokens.numel() - 1;
  const int64_t* cu = cu_tokens.data_ptr<int64_t>();
  if (cu[0] != 0) value_error(Name{std::string("cu_tokens"), -1}, "expected offsets starting at 0");
  for (int64_t b = 0; b < B; ++b)
    if (cu[b + 1] < cu[b]) value_error(Name{std::string("cu_tokens"), -1}, "expected non-decreasing offsets");
  py::object seq = fast_sequence(values, whole, "a padded [B, L] tensor or a list of B per-sample sequences");
  const int64_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  if (n != B)
    value_error(whole, "expected " + std::to_string(B) + " per-sample sequences (one per sample), got " +
                           std::to_string(n));
  const Kind k = kind == "mask" ? Kind::Mask : Kind::Values;
  std::vector<Part> parts;
  parts.reserve(B);
  for (int64_t b = 0; b < B; ++b) {
    parts.push_back(open_part(PySequence_Fast_GET_ITEM(seq.ptr(), b), Name{name, b}, k));
    const int64_t len = cu[b + 1] - cu[b];
    if (parts.back().n != len)
      value_error(Name{name, b}, "expected " + std::to_string(len) + " values (the sample's length), got " +
                                     std::to_string(parts.back().n));
  }
  torch::Tensor out = empty_output({cu[B]}, k == Kind::Mask ? torch::kBool : torch::kFloat32);
  bool floating = B == 0;
  for (int64_t b = 0; b < B; ++b) {
    if (k == Kind::Mask) {
      read_mask(parts[b], Name{name, b}, reinterpret_cast<uint8_t*>(out.data_ptr<bool>()) + cu[b]);
    } else {
      floating = read_values(parts[b], Name{name, b}, out.data_ptr<float>() + cu[b]) || floating;
    }
  }
  if (k == Kind::Values && require_float && !floating) type_error(whole, "expected floating-point values");
  return out;
}

const std::string kIds = "sample['input_ids']";
const std::string kMask = "sample['completion_mask']";
const std::string kOld = "sample['old_log_probs']";
const std::string kAdv = "sample['advantage']";
const std::string kSample = "sample";

PyTypeObject* mapping_type() {
  static PyObject* t = py::object(py::module_::import("collections.abc").attr("Mapping")).release().ptr();
  return reinterpret_cast<PyTypeObject*>(t);
}

// sample[key] (a new reference), or None when absent and not required.
py::object field(py::handle sample, const char* key, const std::string& name, bool required) {
  PyObject* o = sample.ptr();
  py::object v;
  if (PyDict_Check(o)) {
    PyObject* item = PyDict_GetItemString(o, key);
    if (item) v = py::reinterpret_borrow<py::object>(item);
  } else {
    const int is_mapping = PyObject_IsInstance(o, reinterpret_cast<PyObject*>(mapping_type()));
    if (is_mapping < 0) throw py::error_already_set();
    if (!is_mapping) type_error(Name{kSample, -1}, "expected a dict of the sample's fields, got " + type_name(o));
    py::object k = py::str(key);
    if (sample.contains(k)) v = sample[k];
  }
  if (!v && required) value_error(Name{name, -1}, "missing (a sample needs 'input_ids' and 'completion_mask')");
  return v;
}

// The trie of one row, fed TRL's rollout dicts (fields as lists, numpy arrays or tensors).
class PyTrie {
 public:
  explicit PyTrie(bool next_key) : trie_(next_key) {}

  int64_t match(py::handle sample, int64_t group) {
    check_group(group);
    const int64_t n = ids(sample);
    return trie_.match(ids_.data(), n, group);
  }

  bool fits(py::handle sample, int64_t group, int64_t budget) {
    check_group(group);
    if (budget < 0) value_error(Name{std::string("budget"), -1}, "expected an int >= 0");
    const int64_t n = ids_and_mask(sample);
    int64_t trained = 0;
    for (int64_t i = 0; i < n; ++i) trained += mask_[i];
    const int64_t novel = n - trie_.match(ids_.data(), n, group);
    return trie_.num_nodes() + novel <= budget && trie_.trained() + trained <= budget;
  }

  void add(py::handle sample, int64_t group) {
    check_group(group);
    const int64_t n = ids_and_mask(sample);
    py::object old = field(sample, "old_log_probs", kOld, false);
    if (old) {  // a short one would shift every later sample's values at pack()
      const Part p = open_part(old, Name{kOld, -1}, Kind::Values);
      if (p.n != n)
        value_error(Name{kOld, -1}, "expected " + std::to_string(n) + " values (one per token), got " +
                                        std::to_string(p.n));
      values_.resize(n);  // read (and so checked) now; pack() reads the sample again, held by reference
      read_values(p, Name{kOld, -1}, values_.data());
    }
    trie_.add(ids_.data(), mask_.data(), n, group);
  }

  int64_t num_nodes() const { return trie_.num_nodes(); }
  int64_t num_samples() const { return trie_.num_samples(); }
  int64_t load() const { return trie_.load(); }
  int64_t trained() const { return trie_.trained(); }
  torch::Tensor node_tokens() const { return trie_.node_tokens(); }
  torch::Tensor cu() const { return torch::tensor(trie_.cu(), torch::dtype(torch::kInt64)); }
  std::vector<torch::Tensor> layout() const { return trie_.layout(); }

  // (old_log_probs [M], advantages [M]) float32 of the targets (token_pos, segment_id: the layout's
  // outputs 11 and 12), read from the row's samples, in the order they were added.
  py::tuple target_values(py::handle samples, const torch::Tensor& token_pos, const torch::Tensor& segment_id) const {
    const std::string name = "samples";
    py::object seq = fast_sequence(samples, Name{name, -1}, "the row's sample dicts");
    const int64_t B = trie_.num_samples();
    if (PySequence_Fast_GET_SIZE(seq.ptr()) != B)
      value_error(Name{name, -1}, "expected the row's " + std::to_string(B) + " samples");
    for (const torch::Tensor* t : {&token_pos, &segment_id})
      if (t->dim() != 1 || t->scalar_type() != torch::kInt64 || !t->is_contiguous() || !t->device().is_cpu() ||
          t->numel() != token_pos.numel())
        value_error(Name{std::string("token_pos, segment_id"), -1}, "expected contiguous int64 CPU tensors [M]");
    const std::vector<int64_t>& cu = trie_.cu();
    const int64_t M = token_pos.numel();
    torch::Tensor old_out = empty_output({M}, torch::kFloat32), adv_out = empty_output({M}, torch::kFloat32);
    const int64_t* tp = token_pos.data_ptr<int64_t>();
    const int64_t* sg = segment_id.data_ptr<int64_t>();
    float* o = old_out.data_ptr<float>();
    float* a = adv_out.data_ptr<float>();
    int64_t m = 0;
    for (int64_t b = 0; b < B; ++b) {
      py::handle s = PySequence_Fast_GET_ITEM(seq.ptr(), b);
      py::object old = field(s, "old_log_probs", kOld, true);
      const Part p = open_part(old, Name{kOld, -1}, Kind::Values);
      const int64_t n = cu[b + 1] - cu[b];
      if (p.n != n)
        value_error(Name{kOld, -1},
                    "expected " + std::to_string(n) + " values (one per token), got " + std::to_string(p.n));
      py::object adv = field(s, "advantage", kAdv, true);
      const double v = PyFloat_AsDouble(adv.ptr());
      if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        type_error(Name{kAdv, -1}, "expected a number, got " + type_name(adv.ptr()));
      }
      // Sample b's targets: the next run of segment_id == b (targets are sample-major). Only the
      // trained positions are read (add() read and checked the whole field).
      for (; m < M && sg[m] == b; ++m) {
        const int64_t q = tp[m];
        if (q < 0 || q >= n) break;
        o[m] = value_at(p, q, Name{kOld, -1});
        a[m] = static_cast<float>(v);
      }
    }
    if (m != M) value_error(Name{std::string("token_pos, segment_id"), -1}, "a target outside the row's samples");
    return py::make_tuple(old_out, adv_out);
  }

 private:
  static void check_group(int64_t group) {
    if (group < -1) value_error(Name{std::string("group"), -1}, "expected -1 (no groups) or a group code >= 0");
  }

  // Reads sample['input_ids'] into ids_; returns its length.
  int64_t ids(py::handle sample) { return read_ids_of(field(sample, "input_ids", kIds, true)); }

  int64_t read_ids_of(py::handle x) {
    const Part p = open_part(x, Name{kIds, -1}, Kind::Ids);
    ids_.resize(p.n);
    read_ids(p, Name{kIds, -1}, ids_.data());
    return p.n;
  }

  // Reads input_ids and completion_mask (a 0/1 mask shaped like the ids) into ids_ and mask_.
  int64_t ids_and_mask(py::handle sample) {
    // Both fields' presence first, so a missing one is named before the other is read.
    py::object x = field(sample, "input_ids", kIds, true);
    py::object m = field(sample, "completion_mask", kMask, true);
    const int64_t n = read_ids_of(x);
    const Part p = open_part(m, Name{kMask, -1}, Kind::Mask);
    if (p.ndim != 1 || p.n != n)
      value_error(Name{kMask, -1}, "expected shape (" + std::to_string(n) + ",) (like input_ids), got " + shape_of(m));
    mask_.resize(n);
    read_mask(p, Name{kMask, -1}, mask_.data());
    return n;
  }

  PrefixTrie trie_;
  std::vector<int64_t> ids_;  // the sample being read (scratch)
  std::vector<uint8_t> mask_;
  std::vector<float> values_;
};

}  // namespace

void bind_packing(py::module_& m) {
  m.def("read_token_ids", &read_token_ids, py::arg("samples"), py::arg("name"),
        "(tokens [T] int64, cu_tokens [B+1] int64) of B per-sample token-id sequences (lists, numpy arrays, "
        "tensors), checked");
  m.def("read_per_token", &read_per_token, py::arg("values"), py::arg("name"), py::arg("cu_tokens"), py::arg("kind"),
        py::arg("require_float"),
        "A per-token field given per sample, flattened: a 0/1 mask as bool, or numbers as float32");
  py::class_<PyTrie>(m, "PrefixTrie")
      .def(py::init<bool>(), py::arg("next_key"))
      .def("match", &PyTrie::match, py::arg("sample"), py::arg("group"))
      .def("fits", &PyTrie::fits, py::arg("sample"), py::arg("group"), py::arg("budget"))
      .def("add", &PyTrie::add, py::arg("sample"), py::arg("group"))
      .def("num_nodes", &PyTrie::num_nodes)
      .def("num_samples", &PyTrie::num_samples)
      .def("load", &PyTrie::load)
      .def("trained", &PyTrie::trained)
      .def("node_tokens", &PyTrie::node_tokens)
      .def("cu", &PyTrie::cu)
      .def("layout", &PyTrie::layout)
      .def("target_values", &PyTrie::target_values, py::arg("samples"), py::arg("token_pos"),
           py::arg("segment_id"));
}

}  // namespace rlvr
