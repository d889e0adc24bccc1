"""Network lab, benchmarks, experiments and the scapy dissector (installed as ``ltp_tools``)."""
