"""What can bias a GPU timing, sampled from NVML while the steps are timed: SM and memory clocks, temperature,
power draw against the power limit, and the reasons the driver gives for holding the clocks down.

`ClockMonitor` samples in a background thread between `start()` and `stop()` (several windows add up) and
`summary()` gives the run table's columns; without a GPU or without NVML (nvidia-ml-py) every column is
missing (NaN, ''), never an error.
"""

from __future__ import annotations

import math
import statistics
import threading

import torch

# Throttle reasons that lower the clocks below what the step would get (NVML's clocks-event reasons); the
# others (idle, the application clock setting, display clocks, sync boost) say nothing about a loaded GPU.
SLOWDOWN = {
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
}
COLUMNS = ("sm_clock_mhz", "mem_clock_mhz", "gpu_temp_max_c", "power_limit_w", "throttle_reasons", "throttled_share")


def empty_summary() -> dict:
    return {c: "" if c == "throttle_reasons" else math.nan for c in COLUMNS}


class ClockMonitor:
    def __init__(self, device: torch.device | str, *, interval_s: float = 0.1):
        self.device, self.interval_s = torch.device(device), interval_s
        self.samples: list[tuple[float, float, float, int]] = []  # sm MHz, mem MHz, temperature C, reasons mask
        self.power_limit_w = math.nan
        self.handle, self._thread, self._stop = None, None, threading.Event()
        if self.device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            p = torch.cuda.get_device_properties(self.device)
            bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1e3
        except Exception:  # noqa: BLE001 - no NVML: the columns stay missing
            self.handle = None

    def _sample(self) -> None:
        n = self._nvml
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        self.samples.append((n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM),
                             n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_MEM),
                             n.nvmlDeviceGetTemperature(self.handle, n.NVML_TEMPERATURE_GPU),
                             int(reasons(self.handle))))

    def _run(self) -> None:
        try:
            while True:
                self._sample()
                if self._stop.wait(self.interval_s):
                    return
        except Exception:  # noqa: BLE001 - NVML went away mid-run: keep what was sampled
            return

    def start(self) -> None:
        if self.handle is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nvml-clocks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def summary(self) -> dict:
        """Median SM and memory clocks, the highest temperature, the enforced power limit, the slowdown reasons
        seen (comma-separated names, '' if none) and the share of samples that had one."""
        if not self.samples:
            return empty_summary() | {"power_limit_w": self.power_limit_w}
        sm, mem, temp, masks = zip(*self.samples)
        seen = sorted({name for mask in masks for bit, name in SLOWDOWN.items() if mask & bit})
        slowed = sum(1 for mask in masks if any(mask & bit for bit in SLOWDOWN))
        return {"sm_clock_mhz": statistics.median(sm), "mem_clock_mhz": statistics.median(mem),
                "gpu_temp_max_c": float(max(temp)), "power_limit_w": self.power_limit_w,
                "throttle_reasons": ",".join(seen), "throttled_share": slowed / len(masks)}
