"""Repeated blocks compiled once and reused per instance (``regions=``).
"""
