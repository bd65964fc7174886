"""Devices and VirtualDevice generation (no TensorFlow import)."""
from tfpar.cluster.devices import device_names, short_name
from tfpar.cluster.virtual_device import DeviceAssignment, assign_devices

__all__ = ["DeviceAssignment", "assign_devices", "device_names", "short_name"]
