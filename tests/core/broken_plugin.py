raise RuntimeError("this module must only be imported when selected")
