#include "cpu_cores.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <utility>

namespace certkv::tools {
namespace {

bool read_int(const std::filesystem::path& path, int* out) {
  std::ifstream in(path);
  return static_cast<bool>(in >> *out);
}

// The CPUs of /sys/devices/system/cpu/online ("0-3,6"), or none when it cannot be read.
std::set<int> online_cpus() {
  std::set<int> cpus;
  std::ifstream in("/sys/devices/system/cpu/online");
  std::string list;
  if (!(in >> list)) return cpus;
  size_t at = 0;
  while (at < list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, comma - at);
    at = comma + 1;
    const size_t dash = item.find('-');
    try {
      const int lo = std::stoi(item.substr(0, dash));
      const int hi = dash == std::string::npos ? lo : std::stoi(item.substr(dash + 1));
      for (int c = lo; c <= hi; ++c) cpus.insert(c);
    } catch (const std::exception&) {
      return {};
    }
  }
  return cpus;
}

int cores_from_sysfs() {
  std::set<std::pair<int, int>> cores;
  for (int cpu : online_cpus()) {
    const std::filesystem::path topology =
        "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology";
    int package = 0, core = 0;
    if (!read_int(topology / "physical_package_id", &package) || !read_int(topology / "core_id", &core))
      return 0;
    cores.insert({package, core});
  }
  return int(cores.size());
}

int cores_from_cpuinfo() {
  std::ifstream in("/proc/cpuinfo");
  std::set<std::pair<int, int>> cores;
  std::string line;
  int package = -1;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    try {
      if (key == "physical id") package = std::stoi(line.substr(colon + 1));
      if (key == "core id" && package >= 0) cores.insert({package, std::stoi(line.substr(colon + 1))});
    } catch (const std::exception&) {
      return 0;
    }
  }
  return int(cores.size());
}

}  // namespace

int physical_cores() {
  if (const int n = cores_from_sysfs(); n > 0) return n;
  if (const int n = cores_from_cpuinfo(); n > 0) return n;
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? int(n) : 1;
}

}  // namespace certkv::tools
