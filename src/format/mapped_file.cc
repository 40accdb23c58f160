#include "format/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/status.h"

namespace certkv::format {

std::unique_ptr<MappedFile> MappedFile::open(const std::string& path, const std::string& kind) {
  const std::string what = kind + " '" + path + "'";
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) fail(StatusCode::kNotFound, what + " not found");
    fail(StatusCode::kIo, what + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) fail(StatusCode::kIo, what + " is not a regular file");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    fail(StatusCode::kIo, what + ": cannot open: " + std::strerror(err));
  }
  std::unique_ptr<MappedFile> file(new MappedFile());
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* mapping = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      fail(StatusCode::kIo, what + ": cannot map: " + std::strerror(err));
    }
    file->mapping_ = mapping;
  }
  ::close(fd);
  return file;
}

MappedFile::~MappedFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

}  // namespace certkv::format
