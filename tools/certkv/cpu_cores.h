// The number of physical CPU cores, the default of --threads (hyper-threads share a core's
// arithmetic units, so a second thread per core does not speed up the matrix products).
#pragma once

namespace certkv::tools {

// Distinct (physical_package_id, core_id) pairs of the online CPUs in
// /sys/devices/system/cpu/cpu*/topology, else distinct ("physical id", "core id") pairs of
// /proc/cpuinfo, else std::thread::hardware_concurrency(), else 1.
int physical_cores();

}  // namespace certkv::tools
