"""sagellm-plugin-torch-npu: the torch engine on Ascend NPUs (``device = "npu"``).

Importing this package never imports ``torch_npu``: torch-npu without
Ascend's CANN libraries breaks a plain ``import torch`` through its
``torch.backends`` autoload entry point, so it is loaded only when the
``npu`` device is picked, with autoload off (see ``device.py``).
"""
