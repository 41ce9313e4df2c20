"""What users read: ``explain``'s report, its HTML page and layout, health and loss plots.
"""
