//go:build linux

package loader

import (
	"testing"
	"unsafe"

	"github.com/egressd/egressd/pkg/kernelrule"
)

// The Go tables indexed by kernel enums must cover each enum exactly: the
// C sources end every enum in a _LEN sentinel.
func TestTablesMatchKernelEnums(t *testing.T) {
	tests := []struct {
		name string
		got  int
		want int
	}{
		{"kernelrule.ShapeLen", int(kernelrule.ShapeLen), int(egressdShapeSHAPE_LEN)},
		{"kernelrule.SampleKindLen", int(kernelrule.SampleKindLen), int(egressdSampleKindSAMPLE_LEN)},
		{"Histogram.Buckets", HistogramBuckets, len(egressdHist{}.Buckets)},
		{"counters", len(egressdRuleState{}.Counters), int(egressdCounterCOUNTER_LEN)},
		{"MaxSegments", MaxSegments, len(egressdRuleState{}.SegmentCount)},
		{"ruleKeyFixedBits", ruleKeyFixedBits, int(unsafe.Sizeof(egressdRuleKey{}.Port)+unsafe.Sizeof(egressdRuleKey{}.Scope)) * 8},
		{"kernelProtos", len(kernelProtos), int(egressdProtoPROTO_LEN)},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s: %d entries, kernel has %d", tt.name, tt.got, tt.want)
		}
	}
	if ShapeConcurrency != Shape(egressdShapeSHAPE_CONCURRENCY) || ShapePerSecond != Shape(egressdShapeSHAPE_PER_SECOND) || ShapePerWindow != Shape(egressdShapeSHAPE_PER_WINDOW) || ShapeGranted != Shape(egressdShapeSHAPE_GRANTED) {
		t.Error("Shape constants differ from the kernel's enum shape")
	}
	if SampleConnect != SampleKind(egressdSampleKindSAMPLE_CONNECT) || SampleRequest != SampleKind(egressdSampleKindSAMPLE_REQUEST) {
		t.Error("SampleKind constants differ from the kernel's enum sample_kind")
	}
	for i, p := range kernelProtos {
		if int(p.kernel) != i || p.kernel != [...]uint8{uint8(egressdProtoPROTO_TCP), uint8(egressdProtoPROTO_UDP)}[i] {
			t.Errorf("kernelProtos[%d] is protocol %d, the kernel's enum proto says otherwise", i, p.kernel)
		}
	}
}
