package policy_test

import (
	"fmt"
	"net/netip"

	"github.com/egressd/egressd/pkg/kernelrule"
	"github.com/egressd/egressd/pkg/policy"
)

func ExampleParse() {
	_, err := policy.Parse([]byte(`rules:
  - name: payments
    destination: 10.20.0.0/16
    port: 443
    concurency: 50
  - name: email
    destination: smtp.example.com:25
    perSecond: {permits: 0, burst: 20}
`))
	fmt.Println(err)
	// Output:
	// line 2:5: rule payments: no limit: give one of concurrency, perSecond, perWindow or adaptive
	// line 5:5: rule payments: unknown field "concurency" (did you mean concurrency?)
	// line 7:18: rule email: destination "smtp.example.com:25" has a port; write destination: smtp.example.com and port: 25
	// line 8:26: rule email: perSecond.permits must be at least 1
}

func ExampleRule_LoaderRule() {
	p, err := policy.Parse([]byte(`rules:
  - {name: email, destination: smtp.example.com, port: 25, concurrency: 50}
`))
	if err != nil {
		panic(err)
	}
	// What the name resolved to, one address written twice.
	resolved := []netip.Addr{
		netip.MustParseAddr("2001:db8::25"),
		netip.MustParseAddr("192.0.2.25"),
		netip.MustParseAddr("::ffff:192.0.2.25"),
		netip.MustParseAddr("192.0.2.26"),
	}
	r := p.Rules[0].LoaderRule(kernelrule.Scope{}, resolved)
	fmt.Println(r.Name, r.Dests, r.Port, r.Shape, r.Limit, r.Validate())
	// Before the name resolves there is nothing to install.
	r = p.Rules[0].LoaderRule(kernelrule.Scope{}, nil)
	fmt.Println(r.Name, r.Dests, r.Validate() != nil)
	// Output:
	// email [192.0.2.25/32 192.0.2.26/32 2001:db8::25/128] 25 concurrency 50 <nil>
	// email [] true
}
