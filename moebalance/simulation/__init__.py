"""Simulator."""
