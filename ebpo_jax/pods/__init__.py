"""Pods on paper: AOT compilation, memory and step-time reports, topologies, hardware figures."""
