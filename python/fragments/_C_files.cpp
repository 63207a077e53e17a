//===- python/fragments/_C_files.cpp - Saves' rows into their files, GIL off -===//
//
// write_rows: a batch of (path, offset, bytes) written with pwrite, the GIL
// released once for the whole batch. The vLLM worker's saves call it
// (python/fragments/vllm/_rowqueue.py), at the next step or from a writer
// thread: written from Python, each write releases and retakes the GIL, and a
// thread that wants the GIL back while vLLM's host loop holds it waits a switch
// interval (5 ms) per write, so one step's rows (dozens of writes) would fall
// behind the steps. One release per batch keeps the GIL time to building it.
// Files are opened by path per write (no descriptor is shared with Python, so
// none can be closed or reused under a write in flight).
// Called from _C.cpp's module init (bind_files).
//
//===----------------------------------------------------------------------===//
#include <torch/csrc/utils/pybind.h>

#include <cerrno>
#include <cstdint>
#include <fcntl.h>
#include <string>
#include <unistd.h>
#include <vector>

namespace py = pybind11;

namespace frag::python {
namespace {

struct RowWrite {
  std::string path;
  int64_t offset = 0;
  const char* data = nullptr;
  size_t size = 0;
};

/// pwrite of all of `w`; 0, or the errno that stopped it.
int write_one(const RowWrite& w) {
  int fd = ::open(w.path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  size_t done = 0;
  int error = 0;
  while (done < w.size) {
    ssize_t n = ::pwrite(fd, w.data + done, w.size - done, static_cast<off_t>(w.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return error;
}

bool c_contiguous(const py::buffer_info& info) {
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expected) return false;
    expected *= info.shape[d];
  }
  return true;
}

}  // namespace

void bind_files(py::module& m) {
  m.def(
      "write_rows",
      [](const std::vector<std::string>& paths, const std::vector<int64_t>& offsets, const py::list& sources) {
        if (paths.size() != offsets.size() || paths.size() != sources.size())
          throw std::invalid_argument("write_rows: paths, offsets and sources differ in length");
        std::vector<RowWrite> writes(paths.size());
        std::vector<py::buffer_info> held;  // the buffers stay valid while the GIL is off
        held.reserve(paths.size());
        for (size_t i = 0; i < paths.size(); ++i) {
          held.push_back(sources[i].cast<py::buffer>().request());
          const auto& info = held.back();
          if (!c_contiguous(info))
            throw std::invalid_argument("write_rows: source " + std::to_string(i) + " is not contiguous");
          writes[i] = {paths[i], offsets[i], static_cast<const char*>(info.ptr),
                       static_cast<size_t>(info.size * info.itemsize)};
        }
        std::vector<int> errors(writes.size(), 0);
        {
          py::gil_scoped_release released;
          for (size_t i = 0; i < writes.size(); ++i) errors[i] = write_one(writes[i]);
        }
        return errors;
      },
      py::arg("paths"), py::arg("offsets"), py::arg("sources"),
      "Writes each source (a contiguous buffer) at its offset into its file (pwrite, the file opened by path), "
      "the GIL released for the whole batch. Returns an errno per write (0: written).");
}

}  // namespace frag::python
