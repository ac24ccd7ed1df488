"""Platform probes: thin boundaries to host facilities (NVML, ...) that return plain frozen data."""
