"""Adapters for detection and segmentation frameworks (mmdet, mmseg)."""
