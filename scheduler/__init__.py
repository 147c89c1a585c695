"""pagefleet.scheduler"""
