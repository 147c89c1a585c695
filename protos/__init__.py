"""pagefleet.protos"""
