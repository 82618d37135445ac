//go:build !linux

package loader

// ProbeFeatures reports that there is no datapath off Linux.
func ProbeFeatures() []Feature {
	return []Feature{{Kind: FeatureLoad, Name: "egressd datapath", Err: ErrNotSupported}}
}

// InspectPins fails off Linux.
func InspectPins(string) (Pinned, error) { return Pinned{}, ErrNotSupported }
