"""Pods: the kubelet's pod-resources API (client, decoder, `podresources.proto`),
pod names from the kubelet's log directories, and which pod each GPU process and device
belongs to."""
