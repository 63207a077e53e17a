//===- python/fragments/_C_rowsink.cpp - Saves' rows into their files, a thread of its own -===//
//
// RowSink: the rows a vLLM worker saves, written into per-save files by a
// writer thread of the sink's own, with no Python on that thread. Why: per
// step, reserving each request's room in its file and writing its rows from
// Python (a RowFile.reserve and a _C.write_rows entry per request, before this
// sink) cost ~0.9 ms of a 2.6 ms GPU decode step. Here a
// step's block goes in with one put (its parts: file, rows, request step); the
// rows are reserved in C++ and the pwrites run on the thread, without the GIL.
//   open(path, start, row_bytes) -> file id    put(block, files, lo, hi, steps, ready) -> seq
//   release(seq): blocks copied asynchronously become writable    drain()
//   rows / marks / failed / spilled(file id): what the file holds    close(file id)
// Writable blocks are written in put order, a ready one at once even past an
// earlier unreleased one: a file's rows may then land out of order, and rows
// written ahead of a part not yet written keep their block until it is, so that
// should it fail, the file is cut at its row and every part after it is kept in
// memory (spilled), in put order, all the same.
// gather_rows (runtime/row_gather.h): the drain's per-step gathers of a
// steady batch's rows, one launch for every tapped location (_drain.py).
// Called from _C.cpp's module init (bind_row_sink).
//
//===----------------------------------------------------------------------===//
#include "runtime/row_gather.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <fcntl.h>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <pthread.h>
#include <string>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace frag::python {
namespace {

using Marks = std::vector<std::pair<int64_t, int64_t>>;  // (request step, the file's rows at its end)
using Failure = std::pair<int64_t, std::string>;         // (first row of the failed write, strerror)

/// A block's memory, held until its rows are written or spilled. The storage rather than the at::Tensor: a
/// tensor whose Python object dies while C++ still holds it may keep that object alive (PyTorch's PyObject
/// preservation), and its last decref, on the writer, would take the GIL.
struct Rows {
  c10::Storage storage;
  const char* data = nullptr;  // row 0
  int64_t offset = 0;          // row 0's element in the storage
  at::ScalarType dtype = at::kByte;
  std::vector<int64_t> row_shape;
  int64_t row_numel = 0, row_bytes = 0;
};

/// Rows [lo, hi) of a block, of request step `step`, kept in memory: their file failed at or before them (or,
/// in SinkFile::ahead, they were written before an earlier part of their file).
struct Spill {
  int64_t step = 0, lo = 0, hi = 0;
  std::shared_ptr<const Rows> rows;
};

/// A file rows go into: row r at byte start + r * row_bytes. Opened by path for each batch of writes and
/// closed after it, so that thousands of saves held never hold thousands of descriptors.
struct SinkFile {
  int64_t start = 0, row_bytes = 0;
  std::string path;
  std::atomic<bool> closed{false};  // parts not yet written are skipped
  // The Python thread's alone (put reserves):
  int64_t reserved = 0;
  Marks marks;
  // Under the sink's mutex (the writer sets them; it alone, so it reads `failure` without the mutex):
  std::optional<Failure> failure;  // the lowest row a write failed at: the file is cut there
  std::map<int64_t, Spill> spilled;  // by first row: put order
  // The writer's alone: rows before `written_to` are written; parts written past an earlier one
  // not yet written (a ready block past an unreleased one) wait in `ahead`, by first row, with their rows.
  int64_t written_to = 0;
  std::map<int64_t, Spill> ahead;
};

/// The descriptors of one batch of writes, by file: opened at a file's first part, closed after the batch.
class Descriptors {
 public:
  Descriptors() = default;
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors() {
    for (const auto& [file, fd] : fds_)
      if (fd >= 0) ::close(fd);
  }
  /// The file's descriptor, or -errno where it cannot be opened.
  int of(const SinkFile& f) {
    auto it = fds_.find(&f);
    if (it != fds_.end()) return it->second;
    int fd = ::open(f.path.c_str(), O_WRONLY | O_CLOEXEC);
    return fds_.emplace(&f, fd >= 0 ? fd : -errno).first->second;
  }

 private:
  std::unordered_map<const SinkFile*, int> fds_;  // the batch's parts hold the files alive
};

/// Rows [lo, hi) of a block for `file`, its rows from `first_row` on (reserved at put).
struct Part {
  std::shared_ptr<SinkFile> file;
  int64_t lo = 0, hi = 0, step = 0, first_row = 0;
};

struct Block {
  int64_t seq = 0;
  bool ready = false;  // writable without a release
  std::shared_ptr<const Rows> rows;
  std::vector<Part> parts;
};

/// pwrite of all `size` bytes at `offset`: 0, or the errno that stopped it.
int write_all(int fd, const char* data, size_t size, int64_t offset) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

/// A sequence of ints as put reads them (a list or tuple as it is, another sequence through PySequence_Fast):
/// no vector of Python ints is built, the step's put costs about a microsecond.
class IntSeq {
 public:
  explicit IntSeq(const py::handle& seq) {
    PyObject* fast = PySequence_Fast(seq.ptr(), "RowSink.put: files, lo, hi and steps are sequences of ints");
    if (fast == nullptr) throw py::error_already_set();
    owned_ = py::reinterpret_steal<py::object>(fast);
    size_ = static_cast<size_t>(PySequence_Fast_GET_SIZE(fast));
    items_ = PySequence_Fast_ITEMS(fast);
  }
  size_t size() const { return size_; }
  int64_t operator[](size_t i) const {
    long long value = PyLong_AsLongLong(items_[i]);  // numpy's integers too, through __index__
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    return value;
  }

 private:
  py::object owned_;
  PyObject** items_ = nullptr;
  size_t size_ = 0;
};

/// The block's memory as put holds it; ValueError unless a contiguous CPU tensor with a row dimension.
std::shared_ptr<Rows> block_rows(const at::Tensor& block) {
  if (!block.defined() || block.layout() != at::kStrided || !block.device().is_cpu())
    throw py::value_error("RowSink.put: the block is " + (block.defined() ? block.device().str() : "undefined") +
                          ", expected a strided CPU tensor");
  if (block.dim() < 1) throw py::value_error("RowSink.put: the block is 0-d, expected rows (dim >= 1)");
  if (!block.is_contiguous()) throw py::value_error("RowSink.put: the block is not contiguous");
  auto rows = std::make_shared<Rows>();
  rows->storage = block.storage();
  rows->data = static_cast<const char*>(block.const_data_ptr());
  rows->offset = block.storage_offset();
  rows->dtype = block.scalar_type();
  rows->row_shape = block.sizes().slice(1).vec();
  rows->row_numel = c10::multiply_integers(rows->row_shape);
  rows->row_bytes = rows->row_numel * static_cast<int64_t>(block.element_size());
  return rows;
}

/// The marks cut at `rows` as RowFile.cut does: ends clipped, marks left empty dropped.
Marks cut_marks(const Marks& marks, int64_t rows) {
  Marks out;
  for (const auto& [step, end] : marks) {
    int64_t kept = std::min(end, rows);
    if (kept > (out.empty() ? 0 : out.back().second)) out.emplace_back(step, kept);
  }
  return out;
}

/// Spilled rows as a tensor: a view of their block.
at::Tensor spill_tensor(const Spill& spill) {
  const Rows& rows = *spill.rows;
  std::vector<int64_t> sizes{spill.hi - spill.lo};
  sizes.insert(sizes.end(), rows.row_shape.begin(), rows.row_shape.end());
  return at::empty({0}, at::TensorOptions().dtype(rows.dtype))
      .set_(rows.storage, rows.offset + spill.lo * rows.row_numel, sizes);
}

std::string part_where(size_t i) { return "RowSink.put: part " + std::to_string(i) + ": "; }

class RowSink {
 public:
  RowSink() = default;
  RowSink(const RowSink&) = delete;
  RowSink& operator=(const RowSink&) = delete;
  ~RowSink();

  int64_t open(const std::string& path, int64_t start, int64_t row_bytes);
  int64_t put(const at::Tensor& block, const py::handle& files, const py::handle& lo, const py::handle& hi,
              const py::handle& steps, bool ready);
  void release(int64_t seq);
  void drain();  // the binding releases the GIL
  void close(int64_t fid);
  int64_t last() const { return last_; }
  size_t pending();
  int64_t rows(int64_t fid);
  Marks marks(int64_t fid);
  std::optional<Failure> failed(int64_t fid);
  std::vector<std::pair<int64_t, at::Tensor>> spilled(int64_t fid);

 private:
  const std::shared_ptr<SinkFile>& file(int64_t fid) const;
  Part checked_part(size_t i, int64_t fid, int64_t lo, int64_t hi, int64_t block_rows, int64_t row_bytes) const;
  static void reserve(Part& part);
  void start_locked();
  bool writable(const Block& block) const { return block.ready || block.seq <= released_; }
  bool any_writable_locked() const;
  std::vector<std::unique_ptr<Block>> take_locked();
  void write_block(const Block& block, Descriptors& fds);
  void fail(SinkFile& file, const Part& part, const std::shared_ptr<const Rows>& rows, int error);
  void spill(SinkFile& file, const Part& part, const std::shared_ptr<const Rows>& rows);
  void run();

  std::unordered_map<int64_t, std::shared_ptr<SinkFile>> files_;  // the Python thread's alone
  int64_t next_fid_ = 0, last_ = 0;
  std::mutex mu_;  // guards what follows, and SinkFile's failure and spilled
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::unique_ptr<Block>> queue_;  // in put order, not yet taken by the writer
  int64_t released_ = 0;
  size_t in_flight_ = 0;  // blocks the writer took and has not finished
  bool stop_ = false;
  std::thread thread_;
};

RowSink::~RowSink() {
  try {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    if (!thread_.joinable()) return;
    if (PyGILState_Check()) {  // the writer may be dropping a storage that holds a Python object (GIL)
      py::gil_scoped_release released;
      thread_.join();
    } else {
      thread_.join();
    }
  } catch (...) {
  }
}

int64_t RowSink::open(const std::string& path, int64_t start, int64_t row_bytes) {
  if (row_bytes <= 0 || start < 0)
    throw py::value_error("RowSink.open: " + path + ": start " + std::to_string(start) + " and row_bytes " +
                          std::to_string(row_bytes) + ", expected start >= 0 and row_bytes > 0");
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);  // refused here rather than at its first write
  if (fd < 0) {
    PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
    throw py::error_already_set();
  }
  ::close(fd);
  auto file = std::make_shared<SinkFile>();
  file->start = start;
  file->row_bytes = row_bytes;
  file->path = path;
  files_.emplace(next_fid_, std::move(file));
  return next_fid_++;
}

const std::shared_ptr<SinkFile>& RowSink::file(int64_t fid) const {
  auto it = files_.find(fid);
  if (it == files_.end())
    throw py::value_error("RowSink: file id " + std::to_string(fid) + " is not open (unknown or closed)");
  return it->second;
}

/// Part i of a put, checked against its file and the block (ValueError naming i).
Part RowSink::checked_part(size_t i, int64_t fid, int64_t lo, int64_t hi, int64_t block_rows,
                           int64_t row_bytes) const {
  auto it = files_.find(fid);
  if (it == files_.end())
    throw py::value_error(part_where(i) + "file id " + std::to_string(fid) + " is not open (unknown or closed)");
  if (lo < 0 || lo > hi || hi > block_rows)
    throw py::value_error(part_where(i) + "rows [" + std::to_string(lo) + ", " + std::to_string(hi) +
                          "), expected 0 <= lo <= hi <= " + std::to_string(block_rows) + " (the block's rows)");
  const SinkFile& file = *it->second;
  if (file.row_bytes != row_bytes)
    throw py::value_error(part_where(i) + "the block's rows are " + std::to_string(row_bytes) + " bytes, file " +
                          std::to_string(fid) + " (" + file.path + ") expects rows of " +
                          std::to_string(file.row_bytes) + " bytes");
  return Part{it->second, lo, hi, 0, 0};
}

/// Room for the part's rows after those put before (its byte offset fixed now, in put order), and its mark:
/// consecutive parts of one step make one (as RowFile.reserve).
void RowSink::reserve(Part& part) {
  SinkFile& file = *part.file;
  part.first_row = file.reserved;
  file.reserved += part.hi - part.lo;
  if (!file.marks.empty() && file.marks.back().first == part.step)
    file.marks.back().second = file.reserved;
  else
    file.marks.emplace_back(part.step, file.reserved);
}

int64_t RowSink::put(const at::Tensor& block, const py::handle& files, const py::handle& lo, const py::handle& hi,
                     const py::handle& steps, bool ready) {
  auto rows = block_rows(block);
  IntSeq fids(files), los(lo), his(hi), step_of(steps);
  size_t n = fids.size();
  if (los.size() != n || his.size() != n || step_of.size() != n)
    throw py::value_error("RowSink.put: files, lo, hi and steps have " + std::to_string(n) + ", " +
                          std::to_string(los.size()) + ", " + std::to_string(his.size()) + " and " +
                          std::to_string(step_of.size()) + " entries, expected equal lengths");
  auto queued = std::make_unique<Block>();
  queued->parts.reserve(n);
  for (size_t i = 0; i < n; ++i) {  // every part checked before any is reserved: a refused put changes nothing
    queued->parts.push_back(checked_part(i, fids[i], los[i], his[i], block.size(0), rows->row_bytes));
    queued->parts.back().step = step_of[i];
  }
  auto& parts = queued->parts;  // parts without rows have nothing to write and no mark
  parts.erase(std::remove_if(parts.begin(), parts.end(), [](const Part& p) { return p.lo == p.hi; }), parts.end());
  for (Part& part : parts) reserve(part);
  queued->rows = std::move(rows);
  queued->ready = ready;
  std::lock_guard<std::mutex> lock(mu_);
  queued->seq = ++last_;
  if (parts.empty()) return last_;
  queue_.push_back(std::move(queued));
  if (ready) {
    start_locked();
    work_cv_.notify_one();
  }
  return last_;
}

void RowSink::release(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  released_ = std::max(released_, std::min(seq, last_));  // only blocks already put: later ones wait for theirs
  if (queue_.empty()) return;
  start_locked();
  work_cv_.notify_one();
}

void RowSink::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return in_flight_ == 0 && !any_writable_locked(); });
}

void RowSink::close(int64_t fid) {
  std::shared_ptr<SinkFile> gone = file(fid);  // freed with the last part holding it
  files_.erase(fid);
  gone->closed.store(true, std::memory_order_release);  // for parts the writer has taken
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& block : queue_) {
    auto& parts = block->parts;
    parts.erase(std::remove_if(parts.begin(), parts.end(), [&](const Part& p) { return p.file == gone; }),
                parts.end());
  }
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(), [](const auto& b) { return b->parts.empty(); }),
               queue_.end());
}

size_t RowSink::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + in_flight_;
}

int64_t RowSink::rows(int64_t fid) {
  const SinkFile& f = *file(fid);
  std::lock_guard<std::mutex> lock(mu_);
  return f.failure ? f.failure->first : f.reserved;
}

Marks RowSink::marks(int64_t fid) {
  const SinkFile& f = *file(fid);
  std::lock_guard<std::mutex> lock(mu_);
  return f.failure ? cut_marks(f.marks, f.failure->first) : f.marks;
}

std::optional<Failure> RowSink::failed(int64_t fid) {
  const SinkFile& f = *file(fid);
  std::lock_guard<std::mutex> lock(mu_);
  return f.failure;
}

std::vector<std::pair<int64_t, at::Tensor>> RowSink::spilled(int64_t fid) {
  const SinkFile& f = *file(fid);
  std::vector<Spill> spills;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : f.spilled) spills.push_back(entry.second);
  }
  std::vector<std::pair<int64_t, at::Tensor>> out;
  out.reserve(spills.size());
  for (const Spill& spill : spills) out.emplace_back(spill.step, spill_tensor(spill));
  return out;
}

/// The writer, once a block can be written.
void RowSink::start_locked() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), "frag-rowsink");
}

bool RowSink::any_writable_locked() const {
  return std::any_of(queue_.begin(), queue_.end(), [&](const auto& block) { return writable(*block); });
}

/// The blocks the writer may write now, out of the queue, in put order.
std::vector<std::unique_ptr<Block>> RowSink::take_locked() {
  std::vector<std::unique_ptr<Block>> taken;
  std::deque<std::unique_ptr<Block>> left;
  for (auto& block : queue_) {
    if (writable(*block))
      taken.push_back(std::move(block));
    else
      left.push_back(std::move(block));
  }
  queue_ = std::move(left);
  return taken;
}

/// A part written: the file is written up to the next part not yet written. Written past one (out of put
/// order), it keeps its rows in `ahead`: should that one fail, the file is cut before both.
void advance(SinkFile& f, const Part& part, const std::shared_ptr<const Rows>& rows) {
  if (part.first_row != f.written_to) {
    f.ahead.emplace(part.first_row, Spill{part.step, part.lo, part.hi, rows});
    return;
  }
  f.written_to = part.first_row + (part.hi - part.lo);
  for (auto it = f.ahead.begin(); it != f.ahead.end() && it->first == f.written_to; it = f.ahead.erase(it))
    f.written_to += it->second.hi - it->second.lo;
}

/// The part's rows kept in memory: its file failed at or before them.
void RowSink::spill(SinkFile& f, const Part& part, const std::shared_ptr<const Rows>& rows) {
  std::lock_guard<std::mutex> lock(mu_);
  f.spilled.emplace(part.first_row, Spill{part.step, part.lo, part.hi, rows});
}

/// The part's write failed: the file is cut at its first row (below any earlier failure's: parts from that
/// row on are spilled unwritten), its rows and those written ahead of it kept in memory.
void RowSink::fail(SinkFile& f, const Part& part, const std::shared_ptr<const Rows>& rows, int error) {
  std::lock_guard<std::mutex> lock(mu_);
  f.failure.emplace(part.first_row, std::error_code(error, std::generic_category()).message());
  f.spilled.emplace(part.first_row, Spill{part.step, part.lo, part.hi, rows});
  auto cut = f.ahead.upper_bound(part.first_row);
  f.spilled.insert(cut, f.ahead.end());
  f.ahead.erase(cut, f.ahead.end());
}

/// Each part of `block` into its file, or spilled where the file was cut at or before its rows; the mutex
/// taken only to record a failure or a spill.
void RowSink::write_block(const Block& block, Descriptors& fds) {
  const Rows& rows = *block.rows;
  for (const Part& part : block.parts) {
    SinkFile& f = *part.file;
    if (f.closed.load(std::memory_order_acquire)) continue;
    if (f.failure && part.first_row >= f.failure->first) {
      spill(f, part, block.rows);
      continue;
    }
    int fd = fds.of(f);
    int error = fd < 0 ? -fd
                       : write_all(fd, rows.data + part.lo * rows.row_bytes,
                                   static_cast<size_t>((part.hi - part.lo) * rows.row_bytes),
                                   f.start + part.first_row * f.row_bytes);
    if (error != 0)
      fail(f, part, block.rows, error);
    else
      advance(f, part, block.rows);
  }
}

/// The writer thread: all writable blocks taken at once under the mutex, written without it.
void RowSink::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || any_writable_locked(); });
    if (stop_) return;
    auto taken = take_locked();
    in_flight_ = taken.size();
    lock.unlock();
    {
      Descriptors fds;
      for (const auto& block : taken) write_block(*block, fds);
    }
    taken.clear();  // the blocks' memory (and closed files) let go without the mutex
    lock.lock();
    in_flight_ = 0;
    idle_cv_.notify_all();
  }
}

}  // namespace

void bind_row_sink(py::module& m) {
  py::class_<RowSink>(m, "RowSink",
                      "Saved rows into per-save files, written by a thread of the sink's own (no Python on it).")
      .def(py::init<>())
      .def("open", &RowSink::open, py::arg("path"), py::arg("start"), py::arg("row_bytes"),
           "Opens an existing file (kept open until close); row r goes at byte start + r * row_bytes. The file id.")
      .def("put", &RowSink::put, py::arg("block"), py::arg("files"), py::arg("lo"), py::arg("hi"), py::arg("steps"),
           py::arg("ready"),
           "Rows [lo[i], hi[i]) of `block` (a contiguous CPU tensor) after the rows put before into file "
           "files[i], of request step steps[i], reserved now. ready=True: writable at once (even past unreleased "
           "blocks); ready=False: after release(s), s >= the returned sequence number.")
      .def("release", &RowSink::release, py::arg("seq"),
           "Blocks put so far with sequence numbers <= seq become writable (later ones wait for a release of theirs).")
      .def_property_readonly("last", &RowSink::last, "The last sequence number put returned (0 before any).")
      .def("drain", &RowSink::drain, py::call_guard<py::gil_scoped_release>(),
           "Waits, the GIL released, until every writable block is written (unreleased ones are not waited for).")
      .def("rows", &RowSink::rows, py::arg("fid"), "The file's rows (after a failure: those before the failed row).")
      .def("marks", &RowSink::marks, py::arg("fid"),
           "[(step, the file's rows at the end of that step's rows)] in put order, cut at a failure.")
      .def("failed", &RowSink::failed, py::arg("fid"), "None, or (first row, strerror) of the write that failed.")
      .def("spilled", &RowSink::spilled, py::arg("fid"),
           "[(step, rows)] of the failed part and every later one for the file, in put order (in memory).")
      .def("close", &RowSink::close, py::arg("fid"),
           "Forgets the file: parts not yet written are skipped (a write in flight ends).")
      .def_property_readonly("pending", &RowSink::pending, "Blocks not yet written or skipped (released or not).");
  m.def("gather_rows", &frag::runtime::gather_rows, py::arg("srcs"), py::arg("indices"), py::arg("outs"),
        "outs[i] = srcs[i][indices[i]] for every i: on a GPU one kernel launch for all (where gather_rows_fused()), "
        "else one index_select each. Indices are not bounds-checked on the GPU: the caller's to keep in range.");
  m.def("gather_rows_fused", &frag::runtime::gather_rows_fused,
        "Whether gather_rows on a GPU is one launch (this build has the CUDA kernel: CMake with nvcc).");
}

}  // namespace frag::python
