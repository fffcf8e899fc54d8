package topics

import (
	"fmt"
	"maps"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/mod/semver"
)

// FieldError names one bad field of a request or message.
type FieldError struct {
	Field   string `json:"field"`
	Message string `json:"message"`
}

// Validate checks a partial settings object against the schema: every key
// must be known and every value of the right type and in range. Values are as
// encoding/json decodes them (float64, bool, string), or as DecodeValue
// does (an int64 for an integer a float64 cannot hold), or as a settings
// command's payload keeps a number with a fraction (a json.Number, which
// no setting takes: SettingsUpdate.UnmarshalJSON). It returns one
// FieldError per bad key, sorted by key, and nil when all is well.
func (s Schema) Validate(partial map[string]any) []FieldError {
	var errs []FieldError
	keys := make([]string, 0, len(partial))
	for k := range partial {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		spec, ok := s[k]
		if !ok {
			errs = append(errs, FieldError{Field: k, Message: "unknown setting"})
			continue
		}
		if msg := spec.check(partial[k]); msg != "" {
			errs = append(errs, FieldError{Field: k, Message: msg})
		}
	}
	return errs
}

// Usable returns the schema without the settings this server could neither
// show as CONTRACT §3 describes them nor check a value against: a type it
// does not know, an enum of no values, a min above its max, a negative
// max_len. It also returns their names, sorted; none: s itself.
func (s Schema) Usable() (Schema, []string) {
	var bad []string
	for name, spec := range s {
		if !spec.usable() {
			bad = append(bad, name)
		}
	}
	if bad == nil {
		return s, nil
	}
	sort.Strings(bad)
	out := make(Schema, len(s)-len(bad))
	for name, spec := range s {
		if spec.usable() {
			out[name] = spec
		}
	}
	return out, bad
}

// maxZoneLookups bounds the time zone names ValidDefaults (and unfit)
// look up in one schema: a device declares a few time zone settings, if
// any.
const maxZoneLookups = 16

// zoneLookups looks time zone names up in the zone database once each,
// and past maxZoneLookups names not at all (looked is then false).
type zoneLookups map[string]bool

func (z zoneLookups) valid(zone string) (valid, looked bool) {
	if valid, ok := z[zone]; ok {
		return valid, true
	}
	if len(z) >= maxZoneLookups {
		return false, false
	}
	valid = ValidTimezone(zone)
	z[zone] = valid
	return valid, true
}

// ValidDefaults returns the schema with each default that is not a value
// of its setting (check, as a PUT's value is checked: of its type, within
// its min and max, its enum's values or its max_len) taken out, as if the
// device had declared none, and the names of those settings, sorted;
// none: s itself. The setting stays: its type and bounds are what a change
// is checked against and what the device takes, and a client building its
// form from a default the device would refuse offers a value that a PUT
// answers with a 422.
//
// A time zone's check reads the zone database (tens of microseconds): each
// name is looked up once, and past maxZoneLookups names a time zone
// default not yet looked up is taken out unchecked, so that a schema of
// thousands of them costs the server's intake no more than a few.
func (s Schema) ValidDefaults() (Schema, []string) {
	var bad []string
	zones := zoneLookups{}
	for name, spec := range s {
		if spec.Default == nil {
			continue
		}
		if zone, ok := spec.Default.(string); ok && spec.Type == SettingTimezone {
			if valid, _ := zones.valid(zone); !valid {
				bad = append(bad, name)
			}
			continue
		}
		if spec.check(spec.Default) != "" {
			bad = append(bad, name)
		}
	}
	if bad == nil {
		return s, nil
	}
	sort.Strings(bad)
	out := maps.Clone(s)
	for _, name := range bad {
		spec := out[name]
		spec.Default = nil
		out[name] = spec
	}
	return out, bad
}

func (spec SettingSpec) usable() bool {
	switch spec.Type {
	case SettingInt, SettingBool, SettingString, SettingEnum, SettingTimezone:
	default:
		return false
	}
	return (spec.Type != SettingEnum || len(spec.Values) > 0) &&
		(spec.Min == nil || spec.Max == nil || *spec.Min <= *spec.Max) && spec.MaxLen >= 0
}

func (spec SettingSpec) check(v any) string {
	switch spec.Type {
	case SettingInt:
		n, ok := integer(v)
		past := !ok && wholePastInt64(v)
		if !ok && !past {
			return "must be an integer"
		}
		if past || (spec.Min != nil && n < int64(*spec.Min)) || (spec.Max != nil && n > int64(*spec.Max)) {
			lo, hi := bound(spec.Min), bound(spec.Max)
			if past {
				// An unbounded side of a device's int ends where its 64
				// bits do.
				if spec.Min == nil {
					lo = strconv.FormatInt(math.MinInt64, 10)
				}
				if spec.Max == nil {
					hi = strconv.FormatInt(math.MaxInt64, 10)
				}
			}
			return fmt.Sprintf("must be between %s and %s", lo, hi)
		}
	case SettingBool:
		if _, ok := v.(bool); !ok {
			return "must be true or false"
		}
	case SettingString:
		str, ok := v.(string)
		if !ok {
			return "must be a string"
		}
		if strings.IndexByte(str, 0) >= 0 {
			// A settings handler is C: it holds the value as a C string,
			// which ends at a NUL, and the bridge reads one without the
			// NULs that end it (docs/reliability.md, bugs 576 and 578).
			return NoNUL
		}
		if spec.MaxLen > 0 && len(str) > spec.MaxLen {
			return fmt.Sprintf("must be at most %d bytes", spec.MaxLen)
		}
	case SettingEnum:
		str, ok := v.(string)
		if !ok {
			return "must be a string"
		}
		for _, allowed := range spec.Values {
			if str == allowed {
				return ""
			}
		}
		return fmt.Sprintf("must be one of %v", spec.Values)
	case SettingTimezone:
		str, ok := v.(string)
		if !ok {
			return "must be a string"
		}
		if !ValidTimezone(str) {
			return "must be an IANA time zone name such as Europe/Berlin"
		}
	default:
		return "has a type this server does not know"
	}
	return ""
}

// NoNUL is the message of a string setting's value that holds a NUL, from
// Validate, and from the server's check of a setting whose schema it does
// not know yet.
const NoNUL = "must not contain a NUL character: a device holds a string setting as a C string"

// integer is v as an int setting holds it, of at most 64 bits (a device's
// int is 1, 2, 4 or 8 bytes): an int64, or a float64 with no fraction
// within int64's range. Compared as int64, bounds past 2^53 are exact.
func integer(v any) (int64, bool) {
	switch x := v.(type) {
	case int64:
		return x, true
	case int:
		return int64(x), true
	case float64:
		// -2^63 is a float64; 2^63 is the first one past int64.
		if x != math.Trunc(x) || x < math.MinInt64 || x >= math.MaxInt64 {
			return 0, false
		}
		return int64(x), true
	}
	return 0, false
}

// wholePastInt64 reports whether v is a whole number no int64 holds, such
// as 1e19: out of an int setting's range, which is what its 422 says,
// rather than not an integer.
func wholePastInt64(v any) bool {
	x, ok := v.(float64)
	return ok && !math.IsInf(x, 0) && x == math.Trunc(x) && (x < math.MinInt64 || x >= math.MaxInt64)
}

func bound(p *int) string {
	if p == nil {
		return "unbounded"
	}
	return fmt.Sprint(*p)
}

// ValidTimezone reports whether name is an IANA time zone name known to this
// system ("UTC" included; "Local" and "" are not names). The files of a
// zoneinfo directory that are not zone names are refused too, though the
// host's time package loads them: "localtime" (the host's own zone),
// "posixrules", "Factory" (no zone: "-00"), and the duplicate trees
// "posix/" and "right/" (leap seconds counted), which a device's time
// zone database does not know by those names. So is a name written as a
// path ("./UTC", "Europe//London", "Europe/./London"), which the host
// opens as the zone's file (docs/reliability.md, bug 561).
func ValidTimezone(name string) bool {
	if name == "" || name == "Local" || len(name) > 64 {
		return false
	}
	switch {
	case name == "localtime", name == "posixrules", name == "Factory",
		strings.HasPrefix(name, "posix/"), strings.HasPrefix(name, "right/"):
		return false
	}
	for part := range strings.SplitSeq(name, "/") {
		if part == "" || part == "." || part == ".." {
			return false
		}
	}
	_, err := time.LoadLocation(name)
	return err == nil
}

// ValidVersion reports whether v is a semantic version such as 1.2.3 or
// 2.0.0-rc.1 (no leading "v").
func ValidVersion(v string) bool {
	if v == "" || len(v) > 64 || v[0] == 'v' {
		return false
	}
	return semver.IsValid("v"+v) && semver.Canonical("v"+v) == "v"+stripBuild(v)
}

func stripBuild(v string) string {
	for i := 0; i < len(v); i++ {
		if v[i] == '+' {
			return v[:i]
		}
	}
	return v
}

// CompareVersions orders two valid semantic versions: -1 if a < b, 0 if
// equal, +1 if a > b. Pre-releases sort before their release.
func CompareVersions(a, b string) int {
	return semver.Compare("v"+a, "v"+b)
}

// SimModel is the model of the simulated device (CONTRACT §4).
const SimModel = "sim-1"

// SimSchema is the settings schema of the simulated device, model
// SimModel (CONTRACT §4): what its bridge reports, and what the server
// checks a change against before the device has reported.
func SimSchema() Schema {
	return Schema{
		"brightness":        {Type: SettingInt, Min: intp(0), Max: intp(100), Default: 50},
		"volume":            {Type: SettingInt, Min: intp(0), Max: intp(100), Default: 50},
		"do_not_disturb":    {Type: SettingBool, Default: false},
		"timezone":          {Type: SettingTimezone, Default: "UTC"},
		"language":          {Type: SettingEnum, Values: []string{"en", "de", "fr", "es", "zh", "ja"}, Default: "en"},
		"display_timeout_s": {Type: SettingInt, Min: intp(5), Max: intp(600), Default: 30},
	}
}

func intp(i int) *int { return &i }
