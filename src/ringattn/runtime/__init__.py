"""What the applications share: the local launcher on torch's elastic agent, time and memory
meters.
"""
