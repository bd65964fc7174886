"""Devices and VirtualDevice generation (no TensorFlow import)."""
from tfpar.cluster.devices import device_names, short_name
from tfpar.cluster.hardware import CATALOG, Hardware, device_hardware
from tfpar.cluster.virtual_device import DeviceAssignment, assign_devices

__all__ = ["CATALOG", "DeviceAssignment", "Hardware", "assign_devices", "device_hardware",
           "device_names", "short_name"]
