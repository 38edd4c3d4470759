"""proxy"""
