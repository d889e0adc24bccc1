"""Parameter server on LTP (installed as ``ltp_ps``)."""
