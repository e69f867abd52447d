"""Drafting methods: one module or package per method, looked up by name in registry.py."""
